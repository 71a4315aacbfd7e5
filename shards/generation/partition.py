"""Cutting a generating model into stages of decoder blocks, and what each stage holds.

TF-free: it reads the preset's ``PresetSpec``. Stage 0 holds the embeddings and blocks
``[0, a)``; the last holds its blocks, the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from shards.errors import PlanError
from shards.generation.preset import DEFAULT_MAX_LENGTH, PresetSpec

__all__ = [
    "GenerationStagePlan",
    "HeadPartPlan",
    "StageCut",
    "cut_blocks",
    "describe_plan",
    "head_part_params",
    "kv_cache_bytes",
    "plan_generation",
    "plan_head_parts",
    "resolve_max_length",
    "stage_params",
    "step_activation_bytes",
]

# Attention scores and their softmax are float32 whatever the model's dtype (stage._Attention).
_SCORE_BYTES = 4


@dataclass(frozen=True)
class StageCut:
    index: int
    first: int  # first decoder block
    last: int  # one past the last

    @property
    def blocks(self) -> int:
        return self.last - self.first


def cut_blocks(num_layers: int, stages: int) -> list[StageCut]:
    """A balanced cut of ``num_layers`` blocks into ``stages`` ranges (the first stages take one
    more block where they do not divide evenly)."""
    if not 1 <= stages <= num_layers:
        raise PlanError(
            f"stages must be between 1 and the model's {num_layers} decoder blocks, got {stages}"
        )
    size, extra = divmod(num_layers, stages)
    cuts = []
    first = 0
    for index in range(stages):
        last = first + size + (1 if index < extra else 0)
        cuts.append(StageCut(index, first, last))
        first = last
    return cuts


def resolve_max_length(spec: PresetSpec, max_sequence_length: int | None) -> int:
    """The slot length: ``max_sequence_length`` or the model's own bound (GPT-2's position rows);
    a model with none (RoPE) takes ``DEFAULT_MAX_LENGTH``."""
    if max_sequence_length is None:
        return spec.default_max_length
    if max_sequence_length < 1:
        raise PlanError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    bound = spec.max_length_bound
    if bound is not None and max_sequence_length > bound:
        raise PlanError(
            f"max_sequence_length {max_sequence_length} is past the model's {bound} position "
            f"rows; use at most {bound}"
        )
    return max_sequence_length


def kv_cache_bytes(spec: PresetSpec, blocks: int, kv_slots: int, max_length: int) -> int:
    """What a stage's KV cache holds: slots (plus the scratch slot padded tokens write into) x
    slot length x its blocks x 2 (keys, values) x kv heads x head dim x dtype bytes."""
    return (
        (kv_slots + 1) * max_length * blocks * 2 * spec.kv_heads * spec.head_dim * spec.dtype_bytes
    )


def _block_params(spec: PresetSpec) -> int:
    c = spec.config
    h, i = spec.hidden_dim, int(c["intermediate_dim"])
    kv = spec.kv_heads * spec.head_dim
    if spec.family == "gpt2":
        # two layer norms, q/k/v/out with biases, a two-layer MLP with biases
        return 2 * 2 * h + 4 * (h * h + h) + (h * i + i) + (i * h + h)
    # llama: two RMS norms, q/o (h x h) and k/v (h x kv heads * head dim) without biases,
    # SwiGLU (gate, up, down)
    return 2 * h + 2 * h * h + 2 * h * kv + 3 * h * i


def stage_params(spec: PresetSpec, cut: StageCut, total_layers: int, head: bool = True) -> int:
    """The parameters a stage actor holds (``shards.generation.weights.build_stage_backbone``):
    its blocks, the final norm, GPT-2's position rows, and the token embedding, whose
    ReversibleEmbedding layer is also the head (tied, or its own matrix beside it, untied): the
    whole vocabulary on the first and last stages, one row on the others (and on a last stage
    whose head is split into part actors, ``head=False``, unless it is also the first)."""
    c = spec.config
    h = spec.hidden_dim
    first, last = cut.first == 0, cut.last == total_layers
    tied = spec.family == "gpt2" or bool(c.get("tie_word_embeddings", False))
    rows = spec.vocabulary_size if first or (last and head) else 1
    params = cut.blocks * _block_params(spec)
    params += rows * h * (1 if tied else 2)
    if spec.family == "gpt2":
        params += int(c["max_sequence_length"]) * h + 2 * h
    else:
        params += h
    return params


def step_activation_bytes(
    spec: PresetSpec, kv_slots: int, max_length: int, *, blocks: bool = True, head_rows: int = 0
) -> int:
    """The activations of the largest step a stage can be sent: every slot prefilling a whole
    slot (R = ``kv_slots`` rows x N = ``max_length`` new tokens, T = R x N, attention reading
    C = ``max_length`` positions). Its decoder blocks run one after the other, so one block's
    tensors: the hidden states in, out and beside the residual (3 x T x hidden); q, k, v (T x
    (heads + 2 kv heads) x head dim); the keys and values read from the cache (2 x R x C x kv
    heads x head dim); the float32 attention scores and their softmax (2 x R x heads x N x C,
    the largest at long slots); the MLP's inner activations (2, Llama's gate and up 3, x T x
    intermediate). Then, with ``head_rows`` of the LM head, the float32 logits of each row's last
    token and their cast (2 x R x ``head_rows``). Summed: a bound on any moment's live set.
    ``blocks=False`` (a head part): the logits alone, and the hidden states they come from."""
    if not blocks:
        return 2 * kv_slots * (head_rows + spec.hidden_dim) * _SCORE_BYTES
    c = spec.config
    tokens = kv_slots * max_length
    heads = int(c.get("num_heads", c.get("num_query_heads", spec.kv_heads)))
    inner = int(c["intermediate_dim"]) * (2 if spec.family == "gpt2" else 3)
    model_dtype = spec.dtype_bytes * (
        3 * tokens * spec.hidden_dim
        + tokens * (heads + 2 * spec.kv_heads) * spec.head_dim
        + 2 * kv_slots * max_length * spec.kv_heads * spec.head_dim
        + tokens * inner
    )
    scores = 2 * kv_slots * heads * max_length * max_length * _SCORE_BYTES
    return model_dtype + scores + 2 * kv_slots * head_rows * _SCORE_BYTES


@dataclass(frozen=True)
class GenerationStagePlan:
    cut: StageCut
    weight_bytes: int
    kv_cache_bytes: int
    # Its largest step's activations (``step_activation_bytes``): in the GPU memory cap, not in
    # ``shardserve plan``'s total.
    step_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    @property
    def planned_peak_bytes(self) -> int:
        """What the stage actor holds at its largest step: weights, KV cache, activations."""
        return self.total_bytes + self.step_bytes


@dataclass(frozen=True)
class HeadPartPlan:
    """One head part actor: vocabulary rows ``[start, stop)`` of the LM head."""

    index: int
    start: int
    stop: int
    weight_bytes: int  # its rows x hidden x dtype bytes
    step_bytes: int  # its largest step: every slot's logits over its rows, float32, and a cast

    @property
    def planned_peak_bytes(self) -> int:
        return self.weight_bytes + self.step_bytes


def head_part_params(spec: PresetSpec, head_parts: int) -> list[int]:
    """The parameters each head part actor holds: its vocabulary rows of the head x hidden."""
    from shards.generation.head_merge import slice_bounds

    bounds = slice_bounds(spec.vocabulary_size, head_parts)
    return [(stop - start) * spec.hidden_dim for start, stop in bounds]


def plan_head_parts(spec: PresetSpec, head_parts: int, kv_slots: int) -> list[HeadPartPlan]:
    """Each head part actor's rows, weights and largest step (none where ``head_parts`` is 1:
    the last stage holds the head)."""
    if head_parts <= 1:
        return []
    from shards.generation.head_merge import slice_bounds

    bounds = slice_bounds(spec.vocabulary_size, head_parts)
    return [
        HeadPartPlan(
            index,
            start,
            stop,
            params * spec.dtype_bytes,
            step_activation_bytes(spec, kv_slots, 1, blocks=False, head_rows=stop - start),
        )
        for index, ((start, stop), params) in enumerate(
            zip(bounds, head_part_params(spec, head_parts), strict=True)
        )
    ]


def plan_generation(
    spec: PresetSpec, stages: int, kv_slots: int, max_length: int, head_parts: int = 1
) -> list[GenerationStagePlan]:
    """Each stage's weights, KV cache and largest step for a cut of ``stages`` ranges of blocks
    (the head parts': ``plan_head_parts``)."""
    plans = []
    for cut in cut_blocks(spec.num_layers, stages):
        head = head_parts == 1 and cut.last == spec.num_layers
        plans.append(
            GenerationStagePlan(
                cut,
                stage_params(spec, cut, spec.num_layers, head_parts == 1) * spec.dtype_bytes,
                kv_cache_bytes(spec, cut.blocks, kv_slots, max_length),
                step_activation_bytes(
                    spec, kv_slots, max_length, head_rows=spec.vocabulary_size if head else 0
                ),
            )
        )
    return plans


def describe_plan(
    spec: PresetSpec,
    plans: list[GenerationStagePlan],
    kv_slots: int,
    max_length: int,
    head_parts: int = 1,
) -> list[str]:
    """``shardserve plan``'s lines for a generating model."""
    from shards.partition.memory_plan import format_size

    bound = (
        f"the model's {spec.max_length_bound} position rows"
        if spec.max_length_bound is not None
        else f"the model has no position bound (RoPE): {DEFAULT_MAX_LENGTH} taken"
    )
    lines = [
        f"{spec.family} causal LM, {spec.num_layers} decoder blocks, generating: "
        f"{kv_slots} KV slots x {max_length} positions ({bound}; --max-sequence-length sets it)",
        f"{'stage':<6} {'blocks':<10} {'weights':>10} {'KV cache':>10} {'total':>10}",
    ]
    last = len(plans) - 1
    for p in plans:
        blocks = f"[{p.cut.first}, {p.cut.last})"
        what = f"{p.cut.index:<6} {blocks:<10} {format_size(p.weight_bytes):>10} "
        what += f"{format_size(p.kv_cache_bytes):>10} {format_size(p.total_bytes):>10}"
        extra = []
        if p.cut.index == 0:
            extra.append("embeddings")
        if p.cut.index == last:
            extra.append("final norm, LM head, sampling" if head_parts == 1 else "final norm")
        lines.append(what + ("  + " + ", ".join(extra) if extra else ""))
    if head_parts > 1:
        from shards.generation.head_merge import slice_bounds

        bounds = slice_bounds(spec.vocabulary_size, head_parts)
        for i, ((start, stop), params) in enumerate(
            zip(bounds, head_part_params(spec, head_parts), strict=True)
        ):
            size = format_size(params * spec.dtype_bytes)
            lines.append(
                f"{'head ' + str(i):<6} {f'[{start}, {stop})':<10} {size:>10} {'-':>10} "
                f"{size:>10}  LM head rows, sampling its slice"
            )
    return lines
