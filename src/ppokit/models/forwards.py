"""Running the models over token batches: the training and sampling forwards, the logprobs, values and rewards read
from them, and the checks that a model's forward allows a layout (the light head, packed rows, a shared prompt).

A value or reward model (a one-label sequence classifier, `models.loading`) maps each of its backbone's hidden states to
a scalar: read at every response position, that gives values; at the last real token, a reward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel

from ppokit.training import algo
from ppokit.errors import UserError
from ppokit.models import packing
from ppokit.models.loading import backbone, unwrap_peft


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """`model` in eval mode (no dropout) inside, in train mode after: the policy while it samples or
    scores its own samples, between training forwards."""
    model.eval()
    try:
        yield model
    finally:
        model.train()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them. (B, L) -> (B, L)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.x.
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def causal_lm_step(model, input_ids, attention_mask, position_ids, cache=None, logits_to_keep: int = 0):
    """One forward of a causal LM with an optional KV cache -> (logits, cache)."""
    kwargs = {_cache_kwarg(type(unwrap_peft(model))): cache} if cache is not None else {}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs)
    new_cache = out.get("cache", None) if "cache" in out else out.get("past_key_values", None)
    return out.logits, new_cache


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """Logits that predict the last `response_length` tokens of each row.

    input_ids, attention_mask: (B, P + R) -> (B, R, V). Only R + 1 positions go through the LM head.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),  # a bool mask (Episodes') as the 0/1 integers models are given
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    return out.logits[:, :-1]


Layout = Union[bool, Callable[[torch.Tensor, torch.Tensor], packing.Rows]]


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, backbone_fn=None, padding_free: Layout = False) -> torch.Tensor:
    """The backbone's last hidden state at every position. (B, L) -> (B, L, H).

    backbone_fn: a stand-in for the backbone with the same call (a `torch.compile`d one, `ppokit.compile`).
    padding_free: True: the rows' real tokens packed several sequences a row (`models.packing`); a layout (ids, mask
    -> `packing.Rows`, e.g. `models.prefix.SharedPrefix`): the rows it makes, with their mask. Either way the states
    are returned in the (B, L) layout, 0 at padding."""
    run = backbone_fn if backbone_fn is not None else backbone(model)
    inputs, back = _backbone_inputs(model, input_ids, attention_mask, padding_free)
    return back(run(**inputs, use_cache=False).last_hidden_state)


def _backbone_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, padding_free: Layout) -> tuple[dict, Callable]:
    """(the backbone's inputs for `hidden_states`, the map of its last hidden state back to the (B, L) layout)."""
    if padding_free:
        rows = (packing.layout if padding_free is True else padding_free)(input_ids, attention_mask)
        mask = rows.attention_mask(getattr(getattr(unwrap_peft(model), "config", None), "_attn_implementation", None))
        return dict(input_ids=rows.ids, attention_mask=mask, position_ids=rows.position_ids), rows.unpack
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),  # a bool mask (Episodes') as the 0/1 integers models are given
        position_ids=position_ids_from_mask(attention_mask),
    ), lambda hidden: hidden


def sharded(model) -> bool:
    """True for a model sharded by FSDP2 (parallel.strategy fsdp): its root unit, a causal LM's embeddings and the head
    tied to them among its weights (`process.parallel._units`), is gathered only by its own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed
        return False
    return isinstance(unwrap_peft(model), FSDPModule)


def from_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, then: Callable[[torch.Tensor], Any],
                       backbone_fn=None, padding_free: Layout = False) -> Any:
    """then(`hidden_states`(...)): what a causal LM's head computes from the backbone's states (the memory-light and
    padding-free logprobs). A sharded model (`sharded`) computes it inside its own forward, so that FSDP gathers the
    root unit's weights for the head as for the embeddings, and reduce-scatters their gradients after the backward:
    the forward runs over the same inputs (its own head on one position, unused) and `then` reads its backbone's
    output. A compiled backbone_fn (`models.compiled.CompiledBackbone`) is put in the backbone's place for that forward."""
    if not sharded(model):
        return then(hidden_states(model, input_ids, attention_mask, backbone_fn, padding_free))
    inputs, back = _backbone_inputs(model, input_ids, attention_mask, padding_free)
    computed = []
    handle = backbone(model).register_forward_hook(lambda module, args, output: computed.append(then(back(output.last_hidden_state))))
    try:
        with backbone_fn.in_place() if backbone_fn is not None else contextlib.nullcontext():
            unwrap_peft(model)(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return computed[0]


def output_head(model):
    """hidden (..., H) -> logits (..., V) as the model's own forward computes them from its last hidden
    state: the output embedding, then the transforms transformers applies after it for some families
    (Cohere's logit_scale, Granite's logits_scaling, Gemma's final_logit_softcapping). Whether that is the
    whole story for a model is checked once against its forward (`check_output_head`)."""
    base = unwrap_peft(model)
    lm_head = base.get_output_embeddings()
    if lm_head is None:
        raise UserError(f"{type(base).__name__} has no output embedding (get_output_embeddings() is None); lm_head_chunk_size and compile need one")
    config = base.config.get_text_config()
    scale = getattr(base, "logit_scale", None) if isinstance(getattr(base, "logit_scale", None), (int, float)) else None
    divide = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return head


@torch.no_grad()
def check_output_head(model, what: str) -> None:
    """Refuse `what` (the switch that needs backbone + `output_head`) for a model whose forward computes its
    logits some other way: a few tokens through both must give the same logits."""
    base = unwrap_peft(model)
    device = next(base.parameters()).device
    vocab = base.get_output_embeddings().weight.shape[0] if base.get_output_embeddings() is not None else 2
    ids = (torch.arange(8, device=device).reshape(2, 4) * 7919) % max(vocab, 1)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0  # one left-padded row, as prompts are
    was_training = base.training
    base.eval()
    try:
        direct = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False).logits.float()
        light = output_head(model)(hidden_states(model, ids, mask)).float()
    finally:
        base.train(was_training)
    gap = (direct - light).abs().max().item()
    if not gap <= 1e-4 * max(1.0, direct.abs().max().item()):
        raise UserError(
            f"{what}: {type(base).__name__}'s forward computes its logits in a way ppokit does not reproduce from the "
            f"last hidden state (largest difference {gap:.3g}); turn {what} off for this model"
        )


def _layout_gap(model, ids: torch.Tensor, mask: torch.Tensor, layout: Layout) -> tuple[float, float]:
    """(largest difference of the states at real tokens between the padded forward and `layout`'s, the largest state)."""
    base = unwrap_peft(model)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            separate = hidden_states(model, ids, mask).float()
            laid_out = hidden_states(model, ids, mask, padding_free=layout).float()
    finally:
        base.train(was_training)
    return (separate - laid_out)[mask].abs().max().item(), separate[mask].abs().max().item()


def _check_ids(model, rows: int, width: int) -> torch.Tensor:
    config = unwrap_peft(model).config.get_text_config()
    device = next(unwrap_peft(model).parameters()).device
    return (torch.arange(rows * width, device=device).reshape(rows, width) * 7919 + 3) % (getattr(config, "vocab_size", None) or 2)


def check_packed_forward(model, what: str) -> None:
    """Refuse `what` (padding-free forwards, `models.packing`) for a model that does not keep packed sequences apart:
    two short sequences packed in one row must give the states each gives in a row of its own. transformers builds the
    packed masks from restarting position ids; a model (or a version) that ignores them lets one sequence attend to
    the other."""
    ids = _check_ids(model, 3, 6)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :4] = False  # left-padded rows, as prompts are: these two share a packed row
    mask[2, :3] = False
    gap, scale = _layout_gap(model, ids, mask, True)
    if not gap <= 1e-4 * max(1.0, scale):
        raise UserError(
            f"{what}: {type(unwrap_peft(model)).__name__} does not keep sequences packed in one row apart (largest difference {gap:.3g} "
            f"from the padded forward; its attention must build masks from restarting position ids, transformers >= 4.57); "
            f"turn {what} off for this model"
        )


def check_shared_forward(model, what: str, layout: Layout) -> None:
    """Refuse `what` (shared-prompt forwards, `models.prefix`) for a model whose attention does not take a 4-D mask as
    given: two rows with a common prompt (one left-padded) and a third of its own, laid out by `layout` (runs of two
    rows), must give the padded forward's states."""
    ids = _check_ids(model, 4, 7)
    ids[1, 2:5] = ids[0, 2:5]  # rows 0 and 1: the prompt ids[0, 2:5], then responses of 2 tokens and 1
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:2, :2] = False
    mask[1, -1] = False
    mask[3, :5] = False
    name = type(unwrap_peft(model)).__name__
    try:
        gap, scale = _layout_gap(model, ids, mask, layout)
    except (RuntimeError, ValueError, TypeError) as error:
        raise UserError(f"{what}: {name} fails on a 4-D attention mask ({str(error).splitlines()[0][:200]}); use attn_implementation "
                        f"sdpa or eager, or turn {what} off") from None
    if not gap <= 1e-4 * max(1.0, scale):
        raise UserError(f"{what}: {name} does not follow a 4-D attention mask (largest difference {gap:.3g} from the padded forward); "
                        f"use attn_implementation sdpa or eager, or turn {what} off")


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    trained_mask: torch.Tensor,
    temperature: float,
    *,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    backbone_fn=None,
    padding_free: Layout = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logprobs (and entropy) of each response token under `model`: THE function every logprob site uses
    (reference pass, training; sampling keeps its own per-step logprobs from the same formula).

    input_ids, attention_mask: (B, P + R), attention_mask True (or 1) on the real tokens the model reads;
    response_ids, trained_mask: (B, R), the response and the tokens whose logprobs are wanted
    -> (logprobs (B, R) float32, entropy (B, R) float32 or None), 0 outside trained_mask.

    chunk_size None and no backbone_fn: the direct computation, logits at the R + 1 last positions from
    the model's forward (`logits_to_keep`: never at prompt positions) and one log-softmax over them.
    chunk_size N: the memory-light head. The backbone's hidden states at the positions that predict a
    trained token (padding is skipped) go through the output layer N at a time, checkpointed
    (`algo.chunked_head_logprobs`), so the full (B, R, V) float32 log-softmax never exists.
    backbone_fn (a compiled backbone) also takes the backbone + head route, in one chunk if chunk_size is None.
    padding_free (ppo.padding_free): the backbone runs over packed rows (`hidden_states`), and the head route above
    takes its states, in one chunk if chunk_size is None.
    Entropy: a detached statistic unless entropy_grad (an entropy bonus in the loss).
    """
    R = response_ids.shape[1]
    if chunk_size is None and backbone_fn is None and not padding_free:
        logits = response_logits(model, input_ids, attention_mask, R)
        if with_entropy:
            logprobs, entropy = algo.logprobs_and_entropy(logits, response_ids, temperature, entropy_grad)
        else:
            logprobs, entropy = algo.logprobs_from_logits(logits, response_ids, temperature), None
        keep = trained_mask.bool()
        return logprobs.masked_fill(~keep, 0.0), (entropy.masked_fill(~keep, 0.0) if entropy is not None else None)
    keep = trained_mask.bool()

    def head(hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        L = hidden.shape[1]
        predicting = hidden[:, L - R - 1 : L - 1][keep]  # (N, H): the state before each real response token
        n = predicting.shape[0]
        return algo.chunked_head_logprobs(
            predicting, output_head(model), response_ids[keep], temperature, chunk_size or max(n, 1), with_entropy, entropy_grad
        )

    logprobs, entropy = from_hidden_states(model, input_ids, attention_mask, head, backbone_fn, padding_free)
    return _scatter(logprobs, keep), (_scatter(entropy, keep) if entropy is not None else None)


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) values at the True positions of mask (B, R) -> (B, R), 0 elsewhere; differentiable."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask, values)


def scalar_outputs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, backbone_fn=None,
                   padding_free: Layout = False) -> torch.Tensor:
    """The scalar head at every position of a one-label sequence classifier. (B, L) -> (B, L) float32.
    padding_free: the backbone over packed rows (`hidden_states`)."""
    hidden = hidden_states(model, input_ids, attention_mask, backbone_fn, padding_free)
    return unwrap_peft(model).score(hidden).squeeze(-1).float()


def response_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int, backbone_fn=None,
                    padding_free: Layout = False) -> torch.Tensor:
    """Value of the state before each response token. (B, P + R) -> (B, R) float32."""
    return scalar_outputs(model, input_ids, attention_mask, backbone_fn, padding_free)[:, -response_length - 1 : -1]


def score_at_last_token(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, padding_free: Layout = False) -> torch.Tensor:
    """Reward-model score at each row's last real token, whatever side the padding is on. (B, L) -> (B,).
    padding_free: the backbone over packed rows (`hidden_states`)."""
    outputs = scalar_outputs(model, input_ids, attention_mask, padding_free=padding_free)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1)).max(-1).values
    return outputs[torch.arange(outputs.shape[0], device=outputs.device), last.clamp(min=0)]


def left_pad(sequences: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (ids (B, P) long, mask (B, P) bool), padded on the left."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = True
    return ids.to(device), mask.to(device)
