"""A transformers mixture-of-experts block's products through the tuned grouped dispatch.

transformers computes a MoE block's routed experts through its experts
interface: with `config._experts_implementation == "grouped_mm"` the routed
rows are sorted by expert and each of the two products (gate+up, then down)
is one `torch._grouped_mm` over every expert, the weights stored (E, N, K).
`patch_experts(model)` switches such blocks to "gemm_tuner": the same
computation, step for step, with both products through `gemm(x, W.mT,
offs=offs)`, whose grouped family's M map picks, call by call (M being the
rows routed), a kernel where one beat torch's grouped product and torch's
product everywhere else. A block is switched only where the database has a
kernel interval for one of its two families; blocks of another
implementation (a loop over experts), with biases, transposed or
interleaved weights or sharded over GPUs (expert parallelism), and the
router and shared experts (plain linear layers, `patch`'s), are left as
they are. `unpatch_experts` switches them back.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tuner.runtime import dispatch

IMPLEMENTATION = "gemm_tuner"
GROUPED = "grouped_mm"


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward, its two products through `gemm`."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    rows = hidden_states[perm // num_top_k].to(self.gate_up_proj.dtype)
    # histc, not bincount: it captures in a CUDA graph (integer input on CUDA only).
    counts = torch.histc(expert_ids.int() if expert_ids.is_cuda else expert_ids.float(), bins=self.num_experts,
                         min=0, max=self.num_experts - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = self._apply_gate(dispatch.gemm(rows, self.gate_up_proj.mT, offs=offs))
    out = dispatch.gemm(out, self.down_proj.mT, offs=offs)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    # Back to token order and summed over a token's experts as transformers
    # does (in fp32-accumulating sum, not an atomic index_add).
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def register() -> bool:
    """Make "gemm_tuner" an experts implementation of transformers (False
    where this transformers has no experts interface)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    return True


def grouped_blocks(model: nn.Module) -> list[nn.Module]:
    """The experts modules of `model` that compute through transformers'
    grouped products, in the form `experts_forward` takes."""
    out = []
    for m in model.modules():
        config = getattr(m, "config", None)
        w = getattr(m, "gate_up_proj", None)
        if (getattr(config, "_experts_implementation", None) in (GROUPED, IMPLEMENTATION)
                and isinstance(w, torch.Tensor) and w.dim() == 3 and getattr(m, "has_gate", False)
                and not m.has_bias and not m.is_transposed and m.is_concatenated
                and not getattr(m, "_is_expert_parallel", False)):
            out.append(m)
    return out


def patch_experts(model: nn.Module) -> list[nn.Module]:
    """Switch the grouped experts blocks of `model` whose product families
    have a kernel interval (CUDA weights of a dtype the pool takes) to
    `experts_forward`; returns them."""
    blocks = [m for m in grouped_blocks(model) if _tuned(m)]
    if blocks and not register():
        return []
    for m in blocks:
        use(m, IMPLEMENTATION)
    return blocks


def unpatch_experts(model: nn.Module) -> None:
    for m in grouped_blocks(model):
        if m.config._experts_implementation == IMPLEMENTATION:
            use(m, GROUPED)


def use(block: nn.Module, implementation: str) -> None:
    """Set `block`'s experts implementation. Its config is copied the first
    time: the model's layers share one, and each block is switched on its own."""
    if not getattr(block, "tuner_own_config", False):
        block.config = copy.copy(block.config)
        block.tuner_own_config = True
    block.config._experts_implementation = implementation


def _tuned(block: nn.Module) -> bool:
    """Whether the map of either product's grouped family has a kernel
    interval for the block's device (a CUDA one) and dtype."""
    w_up, w_down = block.gate_up_proj, block.down_proj
    if not w_up.is_cuda or w_up.dtype not in (torch.bfloat16, torch.float16):
        return False
    device = w_up.device.index
    return any(dispatch.kernel_spans(device, w.dtype, w.shape[1], w.shape[2], groups=w.shape[0])[0]
               for w in (w_up, w_down))
