"""What the model wrote: each step the text of the first --logger.log_samples groups trained on, and at each
evaluation that many answers, one JSON object per sample in <run dir>/samples.jsonl. The metrics log (metrics.py)
writes them there and sends the same rows to W&B (tables train/generated_samples, eval/generated_samples) and to
TensorBoard (text). The trainer sends episodes as token ids; the driver, which holds the tokenizer and the prompts'
labels, turns them into text here."""

import hashlib
import json

TEXT_CHARS = 2000  # a longer prompt, response or observation keeps its start and its end
TABLE_COLUMNS = ["step", "group", "prompt", "response", "label", "pred", "reward", "score", "finish_reason",
                 "weight_version_min", "weight_version_max"]


def clip(text: str, limit: int = TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} …[{len(text) - 2 * half} chars cut]… {text[-half:]}"


def capped(value):
    """A label or prediction as kept: a number or None as it is, anything else as clipped text (a code task's label
    may hold all its tests)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return clip(value if isinstance(value, str) else json.dumps(value, default=str))


def turn_spans(action_mask: list) -> list:
    """[(start, mid, end)] per turn: response tokens start:mid the model wrote, mid:end the observation after them.
    A turn starts where the model's tokens start again after an observation."""
    n = len(action_mask)
    starts = [0] + [i for i in range(1, n) if action_mask[i] and not action_mask[i - 1]]
    spans = []
    for start, end in zip(starts, starts[1:] + [n]):
        mid = next((i for i in range(start, end) if not action_mask[i]), end)
        spans.append((start, mid, end))
    return spans


def prompt_key(prompt_ids) -> int:
    """A dataset prompt's key (Episode.prompt_key): 64 bits of a digest of its token ids, the same in every process."""
    data = b"".join(int(i).to_bytes(4, "little", signed=True) for i in prompt_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class SampleText:
    def __init__(self, tokenizer, prompts: list):
        """prompts: the run's tokenised prompts ({"prompt_ids", "label"}), train and eval. An episode's label is
        found by the prompt it answers (Episode.prompt_key, else its prompt tokens): an OpenAI-API agent's calls, an
        environment that opens the conversation itself or an OpenRLHF AgentExecutor may send other prompt tokens."""
        self.tokenizer = tokenizer
        self.labels = {prompt_key(p["prompt_ids"]): p["label"] for p in prompts}

    def rows(self, step: int, episodes: dict) -> list:
        """episodes: kind ("train", "eval") -> [Episode]; one row per sequence trained (each of an episode's
        segments has its own, with the episode's label)."""
        return [self.row(step, kind, ep, part) for kind, eps in episodes.items() for ep in eps
                for part in [*ep.segments, {}]]

    def row(self, step: int, kind: str, ep, part: dict = None) -> dict:
        """part: one of ep.segments (None or {}: the episode's own fields, its last segment)."""
        import dataclasses

        first = ep.segments[0]["prompt_ids"] if ep.segments else ep.prompt_ids
        label = self.labels.get(prompt_key(first) if ep.prompt_key is None else ep.prompt_key)
        seg = dataclasses.replace(ep, segments=[], **(part or {}))
        decode, ids = self.tokenizer.decode, seg.response_ids
        return {"step": step, "kind": kind, "group": ep.request_id.rsplit("-", 1)[0],
                "prompt": clip(decode(seg.prompt_ids)),
                "turns": [{"response": clip(decode(ids[a:b])), "observation": clip(decode(ids[b:c]))}
                          for a, b, c in turn_spans(seg.action_mask)],
                "label": capped(label), "pred": capped(ep.extra_info.get("pred")),
                "reward": ep.reward if seg.seat_reward is None else seg.seat_reward, "score": ep.score,
                **({} if seg.seat is None else {"seat": seg.seat, "episode": ep.request_id}),
                "finish_reason": ep.finish_reason,
                "weight_version_min": min(seg.token_versions, default=None),
                "weight_version_max": max(seg.token_versions, default=None),
                "error": ep.error and ep.error[1]}


def dialogue(turns: list) -> str:
    """The turns as one text: a single answer as it is, several with each response and observation marked."""
    if len(turns) == 1 and not turns[0]["observation"]:
        return turns[0]["response"]
    return "\n".join(f"[{part} {i}] {turn[part]}" for i, turn in enumerate(turns, 1)
                     for part in ("response", "observation") if part == "response" or turn[part])


def table_rows(rows: list) -> list:
    """The rows as W&B table rows (TABLE_COLUMNS); label and prediction as text, so that a column keeps one type."""
    def text(value):
        return None if value is None else str(value)
    return [[r["step"], r["group"], r["prompt"], dialogue(r["turns"]), text(r["label"]), text(r["pred"]), r["reward"],
             r["score"], r["finish_reason"], r["weight_version_min"], r["weight_version_max"]] for r in rows]


def markdown(rows: list) -> str:
    """The rows as TensorBoard text, which renders Markdown: each sample indented four spaces (a code block, shown
    verbatim), samples split by rules."""
    def block(r: dict) -> str:
        header = (f"{r['group']}  reward {r['reward']:.3g}  score {r['score']:.3g}  label {r['label']}  "
                  f"pred {r['pred']}  finish {r['finish_reason']}  "
                  f"versions {r['weight_version_min']}-{r['weight_version_max']}")
        lines = [header, f"[prompt] {r['prompt']}", dialogue(r["turns"])]
        lines += [f"[error] {r['error']}"] if r["error"] else []
        return "\n".join("    " + line for line in "\n".join(lines).splitlines())
    return "\n\n---\n\n".join(block(r) for r in rows)


def console_line(row: dict) -> str:
    """One evaluation answer on one line, whitespace folded."""
    def fold(text, limit: int) -> str:
        return clip(" ".join(str(text).split()), limit)
    return (f"eval answer (step {row['step']}): {fold(row['prompt'], 160)} => {fold(dialogue(row['turns']), 240)} | "
            f"label {fold(row['label'], 60)} | reward {row['reward']:.3g}")
