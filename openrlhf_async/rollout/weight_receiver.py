"""Runs inside each vLLM worker process (vLLM's worker_extension_cls): joins the weight-sync group and loads
the weights the trainer broadcasts."""

import math

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unflatten(buffer: torch.Tensor, bucket: list):
    """Split a flat bucket into (name, tensor) views; bucket is [(name, dtype, shape), ...]."""
    offset = 0
    for name, _, shape in bucket:
        numel = math.prod(shape)
        yield name, buffer[offset : offset + numel].view(shape)
        offset += numel


def open_sync_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float):
    """A process group of its own (outside torch.distributed's default one) for the weight broadcast, whose
    rendezvous and collectives give up after timeout_s: a member that died or hangs makes the others fail in time,
    never wait for ever. Returns (group, its rendezvous store), both kept by the caller: rank 0 (the trainer) serves
    the store."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from vllm.distributed.utils import init_gloo_process_group

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    prefix = PrefixStore("weight_sync", store)
    if backend == "gloo":
        group = init_gloo_process_group(prefix_store=prefix, group_rank=rank, group_size=world_size, timeout=timeout)
    else:
        from vllm.platforms import current_platform

        group = current_platform.stateless_init_device_torch_dist_pg(
            backend=backend, prefix_store=prefix, group_rank=rank, group_size=world_size, timeout=timeout)
    return group, store  # the store must outlive the rendezvous (rank 0 serves it)


class WeightReceiver:
    def init_weight_sync_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                               timeout_s: float):
        rank = rank_offset + self.rank  # self.rank: this worker's rank inside its engine (tensor parallel)
        self._weight_sync_group = None  # a group of earlier members is left behind
        self._weight_sync_group, self._weight_sync_store = open_sync_group(host, port, rank, world_size, backend,
                                                                           timeout_s)

    def receive_weights(self, buckets: list):
        """Receive the broadcast buckets in order, streaming them into vLLM's weight loader."""

        def stream():
            for bucket in buckets:
                numel = sum(math.prod(shape) for _, _, shape in bucket)
                buffer = torch.empty(numel, dtype=DTYPES[bucket[0][1]], device=self.device)
                self._weight_sync_group.broadcast(buffer, root=0).wait()
                yield from unflatten(buffer, bucket)

        self.reload_weights(weights_iterator=stream())
        self._retie_word_embeddings()

    def read_weight(self, name: str) -> list:
        """A parameter as vLLM holds it (tests compare it with the trainer's)."""
        return dict(self.model_runner.model.named_parameters())[name].detach().float().cpu().tolist()

    def _retie_word_embeddings(self):
        # A tied lm_head gets no weights of its own in a reload, so nothing refreshes the copy the head's kernel
        # was prepared from (vLLM-CPU packs it after loading): re-tie it and prepare it again.
        model = self.model_runner.model
        config = getattr(model, "config", None)
        if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head") and hasattr(model, "model"):
            head, embed = model.lm_head, model.model.embed_tokens
            if head.weight is not embed.weight:
                head.weight = embed.weight
            head.quant_method.process_weights_after_loading(head)
