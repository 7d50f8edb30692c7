"""The causal-LM loss through ``polyaccel.ops.linear_cross_entropy``: the logits are never formed.

Recognised: a module with an ``lm_head`` (a linear layer, possibly split over the vocabulary by AutoTP)
whose own class's ``forward`` computes ``loss_function(lm_head(hidden), labels)`` and reads nothing
beyond :data:`KNOWN_NAMES` (the names Hugging Face's Llama, Mistral, Qwen2/3, Qwen3-MoE, Gemma2 and
Phi-3 causal-LM forwards read); a forward that reads anything else might transform the logits before
the loss (Cohere's ``logit_scale``, say) and is left alone. Gemma2's final-logit softcapping
(``tanh(z / c) * c``) is a transform of the logits the fused loss does not reproduce: refused while
``config.final_logit_softcapping`` is set.

How it runs: in training mode, called with ``labels`` (or ``shift_labels``) and ``logits_to_keep`` 0,
the owner's forward runs Hugging Face's own forward without labels while the ``lm_head``, called
inside it as usual (so ZeRO stage 3 gathers its weight around the call and again for its backward),
returns the loss instead of the logits: ``linear_cross_entropy`` of the hidden states and the head's
weight against the shifted labels (``shift_labels`` as given), with ``ignore_index`` and
``num_items_in_batch`` (the sum divided by it) as Hugging Face's loss takes them. The output has that
loss and ``logits=None``. A MoE forward's router auxiliary loss is added as its forward would.
Evaluation (``model.eval()``) and calls without labels run Hugging Face's forward unchanged.

Vocab-parallel (AutoTP split the lm_head's rows over ``tensor``): the op reduces the max and the sum
over the tensor group, and the hidden states' gradient, partial on each rank, is summed over it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from polyaccel.comm.autograd import sum_grad_over
from polyaccel.errors import InvalidArgument, PolyaccelError
from polyaccel.parallel import get_layout
from torch import nn

from .norm import KERNEL_ATTR, call_original
from .rotary import forward_names

#: what the supported causal-LM forwards read (beyond these, a forward may transform the logits)
KNOWN_NAMES = frozenset({
    "CausalLMOutputWithPast", "MoeCausalLMOutputWithPast", "attentions", "cache", "config", "device",
    "final_logit_softcapping", "hidden_states", "last_hidden_state", "lm_head", "load_balancing_loss_func",
    "loss_function", "model", "num_experts", "num_experts_per_tok", "output_router_logits",
    "router_aux_loss_coef", "router_logits", "slice_logits_to_keep", "tanh", "to", "torch", "vocab_size",
    # transformers 4.x: ``hidden_states[:, slice(-logits_to_keep, None), :]`` and the cache's old name
    "int", "isinstance", "past_key_values", "slice",
})
#: keyword arguments the loss consumes (Hugging Face's loss_function takes them through the forward's kwargs)
LOSS_KWARGS = ("shift_labels", "num_items_in_batch", "ignore_index")


@dataclass
class _Request:
    labels: torch.Tensor  # flat, shifted
    ignore_index: int
    num_items: object


@dataclass
class HeadState:
    """What the swapped lm_head needs: the tensor group and its first vocabulary row when it is split."""

    group: object = None
    vocab_start: int | None = None
    pending: _Request | None = field(default=None, repr=False)


def refusal(owner: nn.Module) -> str:
    """Why ``owner``'s loss is not swapped ("" when it is a recognised causal-LM loss)."""
    head = owner._modules.get("lm_head")
    names = set(forward_names(type(owner)))
    if not isinstance(head, nn.Module) or not {"lm_head", "loss_function"} <= names:
        return "its forward does not compute loss_function(lm_head(...))"
    unknown = sorted(names - KNOWN_NAMES)
    if unknown:
        return f"its forward also reads {', '.join(unknown)}, which may transform the logits before the loss"
    cap = getattr(getattr(owner, "config", None), "final_logit_softcapping", None)
    if cap is not None:
        return (f"final_logit_softcapping={cap}: the loss is of tanh(z / {cap}) * {cap}, a transform of the logits "
                "the fused cross-entropy does not apply (Hugging Face's loss is kept)")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or getattr(head, "kind", "linear") != "linear":
        return f"its lm_head ({type(head).__name__}) is not a linear layer with a [vocab, hidden] weight"
    if not isinstance(head, nn.Linear) and get_layout(weight).split is None:
        return f"its lm_head is a {type(head).__name__}, neither nn.Linear nor split over the vocabulary"
    split = get_layout(weight).split
    if split is not None and (split.dim != "tensor" or split.axis != 0 or len(split.sections) != 1):
        return f"its lm_head's weight is split over {split.dim!r} along dim {split.axis}, not its rows over 'tensor'"
    return ""


def head_state(head: nn.Module, mesh) -> HeadState:
    split = get_layout(head.weight).split
    if split is None or split.degree == 1:
        return HeadState()
    return HeadState(group=mesh.group("tensor"), vocab_start=sum(split.sections[0][:split.rank]))


def head_forward(head: nn.Module, original, state: HeadState, x: torch.Tensor, *args, **kwargs):
    request = state.pending
    if request is None or args or kwargs:
        return call_original(head, original, x, *args, **kwargs)
    state.pending = None
    from polyaccel import ops

    hidden = x.reshape(-1, x.shape[-1])
    if hidden.shape[0] != request.labels.shape[0]:
        raise InvalidArgument(f"the causal-LM loss got {hidden.shape[0]} hidden states but {request.labels.shape[0]} "
                              "shifted labels; pass labels (or shift_labels) of the input's [batch, seq] shape")
    if state.group is not None:
        hidden = sum_grad_over(hidden, state.group)  # each rank's part covers its vocabulary columns only
    return ops.linear_cross_entropy(hidden, head.weight, request.labels.to(hidden.device), bias=head.bias,
                                    ignore_index=request.ignore_index, num_items=request.num_items,
                                    group=state.group, vocab_start=state.vocab_start)


@dataclass(frozen=True)
class OwnerSpec:
    signature: inspect.Signature
    var_kw: str | None  # the name of the forward's **kwargs
    adds_aux_loss: bool


def owner_spec(owner: nn.Module) -> OwnerSpec:
    sig = inspect.signature(type(owner).forward)
    params = list(sig.parameters.values())[1:]  # without self
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    return OwnerSpec(sig.replace(parameters=params), var_kw, "router_aux_loss_coef" in forward_names(type(owner)))


def _shifted(labels, shift_labels, ignore_index) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def owner_forward(owner: nn.Module, original, spec: OwnerSpec, state: HeadState, *args, **kwargs):
    try:
        bound = spec.signature.bind(*args, **kwargs)
    except TypeError:
        return call_original(owner, original, *args, **kwargs)
    arguments = dict(bound.arguments)
    extra = dict(arguments.pop(spec.var_kw, None) or {}) if spec.var_kw else {}
    labels, shift_labels = arguments.get("labels"), extra.get("shift_labels")
    keep = arguments.get("logits_to_keep", 0)
    if (not owner.training or (labels is None and shift_labels is None)
            or not (isinstance(keep, int) and keep == 0)):
        return call_original(owner, original, *args, **kwargs)
    ignore_index = extra.pop("ignore_index", -100)
    request = _Request(_shifted(labels, extra.pop("shift_labels", None), ignore_index), ignore_index,
                       extra.pop("num_items_in_batch", None))
    return_dict = extra.pop("return_dict", None)
    arguments["labels"] = None
    state.pending = request
    try:
        out = call_original(owner, original, **arguments, **extra, return_dict=True)
    finally:
        pending, state.pending = state.pending, None
    if pending is not None:
        raise PolyaccelError(f"{type(owner).__name__}'s forward never called its lm_head; the fused loss had no hidden "
                             "states (turn the cross_entropy kernel off for this model)")
    loss = out["logits"]
    aux = out.get("aux_loss") if spec.adds_aux_loss else None
    if aux is not None:
        loss = loss + owner.router_aux_loss_coef * aux.to(loss.device)
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    result = type(out)(loss=loss, **fields)
    if return_dict is None:
        return_dict = getattr(getattr(owner, "config", None), "return_dict", True)
    return result if return_dict else result.to_tuple()


def swap(owner: nn.Module, mesh) -> HeadState:
    head = owner._modules["lm_head"]
    state = head_state(head, mesh)
    head.forward = functools.partial(head_forward, head, head.__dict__.get("forward"), state)
    owner.forward = functools.partial(owner_forward, owner, owner.__dict__.get("forward"), owner_spec(owner), state)
    setattr(owner, KERNEL_ATTR, "cross_entropy")
    return state


__all__ = ["KNOWN_NAMES", "HeadState", "head_forward", "owner_forward", "refusal", "swap"]
