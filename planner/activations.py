"""Activation estimates (formulas, checked against autograd's saved tensors in the tests): one
micro-batch of a model or pipeline stage, this rank's peak along its schedule, and float8's
transient casts."""

from __future__ import annotations

from torch import nn

from engram.config import LORA_TARGETS, JobConfig
from engram.models.args import ModelArgs
from engram.models.transformer import clean_fqn
from parallelisms.activation_checkpoint import is_checkpointed
from parallelisms.parallel_dims import axis_divisors
from parallelisms.pipeline import StagePlan
from planner.results import ActivationEstimate, RankActivations, dtype_bytes
from planner.schedule import in_flight


def _norm_bytes(a: int) -> int:
    """RMSNorm, per element: the fp32 upcast (4), the normalised x in the compute dtype (a, for
    the weight multiply) and the output (a, saved by the layer that consumes it)."""
    return 4 + 2 * a


def _layer_bytes_per_token(
    args: ModelArgs,
    a: int,
    tp: int = 1,
    sp: bool = True,
    cp: int = 1,
    cp_method: str = "ulysses",
) -> int:
    """Activations one decoder layer saves for backward, bytes per token of the whole sequence
    (compute dtype `a`) on one of `tp` tensor-parallel ranks (`sp`: sequence parallel) and one of
    `cp` context-parallel ranks.

    Two RMSNorms over D (and q/k norms for Qwen3). Attention with a fused (flash) SDPA: q, and
    k, v repeated to n_heads, the output (4 a Dq), plus the fp32 log-sum-exp per head; no T x T
    scores. SwiGLU: w1 out, w3 out, silu out, product (4 a F).

    Under TP, heads and the FFN width are split (attention and FFN terms / tp). The norms run
    on the full sequence on every TP rank without sequence parallel (not divided) and on 1/tp
    of it with sequence parallel; then the column-parallel linears save their all-gathered
    input (a D for the attention and for the FFN input), which is not divided. The divisors
    are parallelisms.parallel_dims.axis_divisors'.

    Under CP a rank holds 1/cp of the tokens: every term is divided by cp, except the keys and
    values the kernel saves (k, v repeated to n_heads: 2 a Dq), which are divided by
    `axis_divisors(...).heads`: tp x cp under Ulysses (the kernel holds heads / cp of the whole
    sequence), tp under all-gather K/V (every rank holds the gathered K and V of the whole
    sequence, i.e. cp times its own share). The queries, output and log-sum-exp are 1/(tp x cp)
    under both methods (Ulysses: heads / cp of T tokens; all-gather K/V: its T / cp queries);
    Ulysses saves the output twice (head-sharded in the kernel, token-sharded for wo).
    """
    d = axis_divisors(tp, sp, 1, cp, cp_method)
    assert args.head_dim is not None
    dq, dkv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    # q/k norms: their output goes to RoPE, which saves only cos/sin, so no output term.
    qk_norm = (4 + a) * (dq + dkv) if args.qk_norm else 0
    queries = 2 * a * dq + 4 * args.n_heads + qk_norm  # q, output, fp32 lse (+ q/k norms)
    if cp > 1 and cp_method == "ulysses":
        # The kernel's head-sharded output and the output projection's input (the output
        # all-to-all'd back to tokens) are two tensors; otherwise the latter is a view.
        queries += a * dq
    keys_values = 2 * a * dq  # k, v repeated to n_heads, as the kernel saves them
    norms = 2 * _norm_bytes(a) * args.dim
    gathered = 2 * a * args.dim // cp if tp > 1 and sp else 0
    split = (queries + 4 * a * args.ffn_dim) // (tp * cp) + keys_values // d.heads
    return norms // d.stream_tokens + gathered + split


# Input width of each LoRA target (engram.config.LORA_TARGETS paths): "dim", "dq" (attention
# heads x head_dim) or "ffn"; the row-parallel ones (wo, w2) see 1 / tp of theirs under TP.
_LORA_INPUT = {
    "attention.wq": "dim", "attention.wk": "dim", "attention.wv": "dim", "attention.wo": "dq",
    "feed_forward.w1": "dim", "feed_forward.w3": "dim", "feed_forward.w2": "ffn",
}  # fmt: skip
_ROW_PARALLEL = {"attention.wo", "feed_forward.w2"}


def _lora_bytes_per_token(cfg: JobConfig, args: ModelArgs, a: int, tp: int = 1) -> int:
    """How LoRA (training.mode = "lora", engram/models/lora.py) changes one decoder layer's saved
    activations from _layer_bytes_per_token's, bytes per token on one of `tp` ranks (may be
    negative). Per adapted linear, + h = A x (a x rank, saved by the B GEMM). The frozen norm
    weights need no normalised x: - 2 a D (and - a (Dq + Dkv) for q / k norms). With
    lora.dropout > 0 each adapted linear also saves its dropped input (a) and dropout's mask
    (1 B: bool on CUDA / NPU; on cpu the scaled noise, a) per input element, while the frozen
    base linears save no input of their own: - the norm outputs (2 a D), the attention output
    (a Dq) and the FFN product (a F). Under TP (inputs gathered or split by the plan) the
    savings are not taken (an upper bound). Checked against autograd's saved tensors in
    tests/test_planner_calibration.py."""
    if cfg.training.mode != "lora":
        return 0
    lora = cfg.lora
    assert args.head_dim is not None
    dq = args.n_heads * args.head_dim
    width = {"dim": args.dim, "dq": dq, "ffn": args.ffn_dim}
    mask = a if cfg.job.device == "cpu" else 1
    total = 0
    if tp == 1:
        total -= 2 * a * args.dim
        if args.qk_norm:  # frozen q / k norm weights likewise
            total -= a * (dq + args.n_kv_heads * args.head_dim)
    for target in lora.target_modules:
        path = LORA_TARGETS[target]
        n_in = width[_LORA_INPUT[path]] // (tp if path in _ROW_PARALLEL else 1)
        total += a * lora.rank + ((a + mask) * n_in if lora.dropout > 0 else 0)
    if lora.dropout > 0 and tp == 1:
        total -= a * (2 * args.dim + dq + args.ffn_dim)
    return total


def _engram_bytes_per_token(cfg: JobConfig, dim: int, a: int) -> tuple[int, int]:
    """(saved, transient) bytes per token of an Engram block.

    Saved: the looked-up rows in the compute dtype (a E), key/query/ShortConv RMSNorms over D,
    the value projection and the conv output (2 a D), the gate scalars, and the lookup's int64
    index tensors (2 x 8 H). Transient: the all-to-all buffers (ids int64 x3, rows fp32 x3).
    """
    e = cfg.engram
    engram_dim = (e.max_ngram - 1) * e.n_embed_per_ngram
    saved = a * engram_dim + 3 * _norm_bytes(a) * dim + 2 * a * dim + 32 + 2 * 8 * e.num_heads
    return saved, 3 * 8 * e.num_heads + 3 * 4 * engram_dim


def loss_bytes(cfg: JobConfig, args: ModelArgs, a: int, tp: int, tokens: int, cp: int = 1) -> int:
    """Peak bytes of the loss of one micro-batch of `tokens` (compute dtype `a`) on one of `tp`
    ranks (the logits are vocabulary-parallel under TP) and one of `cp` context-parallel ranks
    (each holds the logits of its tokens / cp).

    Cross-entropy in fp32. The peak is the log-softmax backward: the saved log-softmax output,
    its incoming gradient and the gradient of the fp32 logits (12 bytes/logit) while the model's
    compute-dtype logits (a) are still alive, held by the caller until backward ends
    (engram/train/step.py forward_backward keeps `output`; a pipeline stage keeps its output):
    a + 12 bytes/logit. In forward the logits, the fp32 upcast and the saved log-softmax coexist
    (a + 8, less). In float32 the upcast is the logits themselves (16 = 4 + 12). With
    training.loss_chunks = n > 1 (engram/train/loss.py) that holds for one chunk of ceil(local seq_len / n) positions of every
    sequence (local: seq_len / cp), plus, for the whole micro-batch, the hidden states gathered
    over the sequence and their accumulated gradient (2 a D per local token, not divided by TP),
    and the head's weight gradient sum and one chunk's share in the compute dtype (2 a V D / tp;
    a plain linear head needs only the sum: an upper bound)."""
    vocab = axis_divisors(tp, True).vocab  # the head is vocabulary-parallel in both TP modes
    per_logit = (a + 12) * args.vocab_size // vocab
    chunks = cfg.training.loss_chunks
    if chunks == 1:
        return per_logit * tokens // cp
    seq = cfg.training.seq_len
    chunk_tokens = tokens // seq * -(-(seq // cp) // chunks)
    hidden = 2 * a * args.dim * tokens // cp
    head_grad = 2 * a * args.vocab_size * args.dim // vocab
    return per_logit * chunk_tokens + hidden + head_grad


def cp_mask_bytes(cfg: JobConfig, cp: int, cp_method: str, n_layers: int) -> int:
    """All-gather K/V's cached attention masks: each attention module keeps a bool [T / cp, T]
    mask per sequence length (parallelisms/context_parallel.py AllGatherKVAttention._mask), held
    for the whole run: n_layers x T / cp x T bytes. Ulysses and cp = 1 need none, nor packed
    documents (model.attn_mask_type = block_causal: the documents' mask replaces it)."""
    if cp == 1 or cp_method != "allgather_kv" or cfg.model.attn_mask_type != "causal":
        return 0
    seq_len = cfg.training.seq_len
    return n_layers * (seq_len // cp) * seq_len


def document_mask_bytes(cfg: JobConfig, a: int, tokens: int, cp: int, cp_method: str) -> int:
    """Packed documents kept apart with SDPA (model.attn_mask_type = block_causal, attn_backend =
    sdpa; engram/models/documents.py): the bytes of one layer's attention mask for a micro-batch
    of `tokens` (whole sequences of T). SDPA turns the bool [B, 1, Tq, Tk] mask into an additive
    one in the compute dtype `a` and saves it for backward in every layer (measured on CPU; the
    bool mask itself is shared by the layers and not saved). The kernel sees Tq = Tk = T (one
    rank, TP: every rank, Ulysses: the whole sequence of its heads, so not divided by cp) or
    Tq = T / cp (all-gather K/V). flex: a block mask of B x (T / 128)^2 block indices, no T x T
    tensor, estimated as the fused kernel: 0. causal: 0."""
    m = cfg.model
    if m.attn_mask_type != "block_causal" or m.attn_backend != "sdpa":
        return 0
    seq = cfg.training.seq_len
    queries = seq // cp if cp > 1 and cp_method == "allgather_kv" else seq
    return a * (tokens // seq) * queries * seq


def _cp_backward_bytes(args: ModelArgs, a: int, tp: int, cp: int, cp_method: str) -> int:
    """Per token of the sequence: the attention buffers context parallelism adds to one layer's
    backward. All-gather K/V: the gradients of the gathered K and V repeated to n_heads
    (2 a Dq / tp per token of the whole sequence) and summed back to the KV heads (2 a Dkv / tp)
    before their reduce-scatter. Ulysses: one all-to-all's send and receive copies of the
    q / k / v gradients (2 a (Dq + 2 Dkv) / (tp x cp))."""
    if cp == 1:
        return 0
    assert args.head_dim is not None
    dq, dkv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    if cp_method == "allgather_kv":
        return 2 * a * (dq + dkv) // tp
    return 2 * a * (dq + 2 * dkv) // (tp * cp)


def activation_estimate(
    cfg: JobConfig,
    args: ModelArgs,
    compute_dtype: str,
    tp: int = 1,
    sp: bool = True,
    layers: list[int] | None = None,
    first: bool = True,
    last: bool = True,
    tokens: int | None = None,
    cp: int = 1,
    cp_method: str = "ulysses",
) -> ActivationEstimate:
    """Activation bytes of one micro-batch on one rank, `tp` tensor-parallel ranks with (`sp`)
    or without sequence parallel and `cp` context-parallel ranks (`cp_method`; what each
    divides: parallelisms.parallel_dims.axis_divisors; `tokens` counts whole sequences, a cp
    rank holds 1 / cp of them: _layer_bytes_per_token, loss_bytes).
    Per token, a sequence-sharded tensor costs 1/tp of its bytes: the Engram block in both modes
    (it runs on and looks up only its rank's tokens), the residual stream (checkpoint inputs,
    norms) with sequence parallel; the head- and FFN-split parts always. The loss is
    vocabulary-parallel under TP (loss_parallel): logits / tp.

    A pipeline stage passes its decoder `layers`, whether it is the `first` (embedding ids) and
    the `last` stage (final norm, loss) and its micro-batch `tokens` (default: the local batch)."""
    a = dtype_bytes(compute_dtype)
    d = axis_divisors(tp, sp, 1, cp, cp_method)
    stream_div = d.stream_tokens
    if tokens is None:
        tokens = cfg.training.local_batch_size * cfg.training.seq_len
    layer_ids = range(args.n_layers) if layers is None else layers
    layer = _layer_bytes_per_token(args, a, tp, sp, cp, cp_method)
    layer += _lora_bytes_per_token(cfg, args, a, tp) // cp
    engram_layers = set(cfg.engram.layer_ids) if cfg.engram.enabled else set()
    engram_saved, engram_transient = (
        _engram_bytes_per_token(cfg, args.dim, a) if engram_layers & set(layer_ids) else (0, 0)
    )
    engram_saved //= d.engram_tokens
    engram_transient //= d.engram_tokens
    # Embedding ids; final norm (its output feeds the head).
    saved = (8 // cp if first else 0) + (_norm_bytes(a) * args.dim // stream_div if last else 0)
    if cfg.training.mode == "lora":  # frozen embedding, final norm and head save less
        saved = 4 * args.dim // stream_div if last else 0  # the final norm's fp32 input only
    recompute = 0
    # All-gather K/V: SDPA turns the bool [T / cp, T] mask into an additive one in the compute
    # dtype and saves it for backward, once per layer whatever the batch (measured on CPU).
    # Packed documents: a [B, T / cp or T, T] mask per layer instead (document_mask_bytes).
    seq = cfg.training.seq_len
    mask = a * (seq // cp) * seq if cp > 1 and cp_method == "allgather_kv" else 0
    if cfg.model.attn_mask_type == "block_causal":
        mask = document_mask_bytes(cfg, a, tokens, cp, cp_method)
        # RoPE per document: cos and sin [B, T / cp, head_dim] (fp32 buffer), once per forward.
        assert args.head_dim is not None
        saved += 2 * 4 * args.head_dim // cp
    saved_masks = recompute_mask = 0
    for k, i in enumerate(layer_ids):  # AC counts the layers of the model or stage (k)
        full = layer + (engram_saved if i in engram_layers else 0)
        if is_checkpointed(cfg.activation_checkpoint, k):
            saved += a * args.dim // stream_div  # the checkpoint keeps only the layer input
            recompute = max(recompute, full)
            if mask and not recompute_mask and cfg.model.attn_mask_type == "block_causal":
                # ... and its inputs: the documents' bool mask, one tensor for every layer
                saved_masks += document_mask_bytes(cfg, 1, tokens, cp, cp_method)
            recompute_mask = mask
        else:
            saved += full
            saved_masks += mask
    # Backward temporaries of one layer: gradients of the FFN hidden and of the stream, plus the
    # Engram lookup's all-to-all buffers, and what context parallelism adds to attention.
    backward = (
        2 * a * args.ffn_dim // (d.ffn_width * cp)
        + 2 * a * args.dim // stream_div
        + engram_transient
        + _cp_backward_bytes(args, a, tp, cp, cp_method)
    )
    vocab = axis_divisors(tp, True).vocab
    width = args.vocab_size // vocab if cfg.training.loss_chunks == 1 else args.dim // stream_div
    return ActivationEstimate(
        held_output_bytes=a * width * tokens // cp if last else 0,
        tokens=tokens,
        saved_bytes=saved * tokens + saved_masks,
        recompute_bytes=(recompute + backward) * tokens + recompute_mask,
        loss_bytes=loss_bytes(cfg, args, a, tp, tokens, cp) if last else 0,
        per_layer_full_bytes=layer * tokens,
        per_engram_layer_extra_bytes=engram_saved * tokens,
    )


def rank_activations(
    cfg: JobConfig,
    args: ModelArgs,
    compute_dtype: str,
    tp: int,
    sp: bool,
    plan: StagePlan | None,
    stage_ids: list[int],
    pp_rank: int,
    n_micro: int = 1,
    cp: int = 1,
    cp_method: str = "ulysses",
) -> tuple[RankActivations, list[ActivationEstimate]]:
    """This rank's activations at its peak and every stage's one-micro-batch estimate. Without
    PP one micro-batch (the local batch) is in flight; with PP the micro-batch is local batch /
    pipeline.microbatches and in_flight walks the schedule's own order."""
    if plan is None:
        act = activation_estimate(cfg, args, compute_dtype, tp, sp, cp=cp, cp_method=cp_method)
        ra = RankActivations(
            act.tokens,
            act.saved_bytes,
            {0: 1},
            act.recompute_bytes,
            act.loss_bytes,
            act.held_output_bytes,
        )
        return ra, [act]
    p, pp = cfg.pipeline, max(plan.ranks) + 1
    tokens = cfg.training.local_batch_size // n_micro * cfg.training.seq_len
    last = plan.num_stages - 1
    per_stage = [
        activation_estimate(
            cfg, args, compute_dtype, tp, sp, layers, s == 0, s == last, tokens, cp, cp_method
        )
        for s, layers in enumerate(plan.layers)
    ]
    peak = in_flight(
        p.schedule,
        pp,
        p.virtual_stages,
        n_micro,
        pp_rank,
        {s: per_stage[s].saved_bytes for s in stage_ids},
    )
    ra = RankActivations(
        microbatch_tokens=tokens,
        saved_bytes=peak.peak_bytes,
        in_flight=peak.micro_batches,
        recompute_bytes=max(per_stage[s].recompute_bytes for s in stage_ids),
        loss_bytes=sum(per_stage[s].loss_bytes for s in stage_ids),
        held_output_bytes=sum(per_stage[s].held_output_bytes for s in stage_ids),
    )
    return ra, per_stage


def float8_cast_bytes(model: nn.Module, tokens: int, tp: int = 1) -> tuple[int, str]:
    """(bytes, linear) of the largest float8 working set of one converted linear, which exists
    only while that linear runs: torchao keeps the weight in high precision (FSDP shards and
    gathers it as usual, so no persistent byte changes) and, per matmul, casts the gathered
    weight to float8 (1 B/element, once in forward and once in backward with the other scaling
    axis) and the input / output gradient (1 B/element each, the gradient twice in backward).
    Rowwise and tensorwise alike; scales are negligible."""
    from torchao.float8.float8_linear import Float8Linear

    best, name = 0, ""
    for fqn, m in model.named_modules():
        if isinstance(m, Float8Linear):
            weight = 2 * m.in_features * m.out_features // tp  # the weight is TP-sharded
            # Under TP one of in / out is split, depending on the plan: not divided (upper bound).
            acts = tokens * (m.in_features + 2 * m.out_features)
            if weight + acts > best:
                best, name = weight + acts, clean_fqn(fqn)
    return best, name
