"""Conditional flow matching sampler of CosyVoice2 (the official ``CausalConditionalCFM`` at inference).

The ODE ``dx/dt = v(x, t)`` is integrated from fixed noise at ``t=0`` to the mel at ``t=1`` with Euler steps
on a cosine time grid and classifier-free guidance. The solver only needs a callable estimator, so the same
loop can drive the PyTorch module, an ONNX/TensorRT session or a remote Triton model (BLS).

CFG batch layout: for a batch of B items every step evaluates the estimator ONCE on 2B rows, stacked as
``[cond_1 .. cond_B, uncond_1 .. uncond_B]``; the unconditional rows have ``mu``, ``spks`` and ``cond`` zeroed
(the official code's ``torch.split(out, [B, B])`` layout; it has B=1, rows ``[cond, uncond]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..config import CFMConfig

#: ``estimator_fn(x, mask, mu, t, spks, cond, streaming) -> v``, all batch 2B, v like x.
EstimatorFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "bool | Tensor"], Tensor]


def cfm_noise(frames: int = 15000, channels: int = 80) -> Tensor:
    """The official fixed noise [1, channels, frames]: ``torch.manual_seed(0); torch.randn(...)`` on CPU,
    drawn from a private generator (the global RNG is left alone). Only the release size 15000 reproduces
    the official buffer: another size draws a different tensor, not a prefix of it."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn([1, channels, frames], generator=gen)


def cosine_t_span(n_timesteps: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
                  ) -> Tensor:
    """[n+1] Euler grid ``1 - cos(linspace(0, 1, n+1) * pi/2)``, denser near t=0 (bitwise the official)."""
    t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * math.pi)


def solve_euler(estimator_fn: EstimatorFn, z: Tensor, mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor,
                t_span: Tensor, cfg_rate: float = 0.7, streaming: bool | Tensor = False) -> Tensor:
    """Integrate from noise ``z`` [B, 80, T] over ``t_span`` [n+1] -> x [B, 80, T] (float32).

    mask [B, 1, T], mu/cond [B, 80, T], spks [B, 80]. Each step: ``v = (1+cfg) v_cond - cfg v_uncond``,
    ``x += dt v``. Like the official loop, ``t`` is accumulated (``t += dt``, ``dt = t_span[k+1] - t``)
    rather than read from the grid, which keeps the estimator's ``t`` inputs bitwise the official ones.
    Frames outside ``mask`` keep their noise (the estimator returns 0 there); slice outputs by length.
    """
    if len(t_span) < 2:
        raise ValueError(f"solve_euler: t_span needs at least 2 points (n_timesteps >= 1), got {len(t_span)}")
    b = z.shape[0]
    mask_in = torch.cat([mask, mask])
    mu_in = torch.cat([mu, torch.zeros_like(mu)])
    spks_in = torch.cat([spks, torch.zeros_like(spks)])
    cond_in = torch.cat([cond, torch.zeros_like(cond)])
    x = z
    t = t_span[0:1]
    dt = t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        v = estimator_fn(torch.cat([x, x]), mask_in, mu_in, t.expand(2 * b), spks_in, cond_in, streaming)
        v_cond, v_uncond = v[:b], v[b:]
        x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return x.float()


class CausalConditionalCFM(nn.Module):
    """The flow's ``decoder``: holds ``estimator`` (so the checkpoint's ``decoder.estimator.*`` keys load
    unchanged) and the fixed noise ``rand_noise`` [1, 80, noise_frames], a non-persistent buffer (not in the
    state_dict, moved by ``.to()``). Inference only."""

    rand_noise: Tensor

    def __init__(self, estimator: nn.Module, config: CFMConfig | None = None):
        super().__init__()
        self.config = config or CFMConfig()
        self.estimator = estimator
        self.register_buffer("rand_noise", cfm_noise(self.config.noise_frames), persistent=False)

    def t_span(self, n_timesteps: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
               ) -> Tensor:
        """The configured grid: cosine (the release) or linear."""
        if self.config.t_scheduler == "cosine":
            return cosine_t_span(n_timesteps, device, dtype)
        return torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)

    def noise(self, frames: int) -> Tensor:
        """The official ``z`` before temperature: ``rand_noise[:, :, :frames]`` [1, 80, frames]."""
        if frames > self.rand_noise.shape[-1]:
            raise ValueError(f"{frames} mel frames exceed the {self.rand_noise.shape[-1]}-frame noise buffer "
                             f"({self.rand_noise.shape[-1] // 50} s)")
        return self.rand_noise[:, :, :frames]

    @torch.inference_mode()
    def forward(self, mu: Tensor, mask: Tensor, spks: Tensor, cond: Tensor, n_timesteps: int | None = None,
                temperature: float = 1.0, streaming: bool | Tensor = False, noise: Tensor | None = None,
                estimator_fn: EstimatorFn | None = None) -> Tensor:
        """mu/cond [B, 80, T], mask [B, 1, T], spks [B, 80] -> mel [B, 80, T] (float32).

        ``noise`` [B or 1, 80, T] replaces the buffer slice (before ``temperature``); by default every item
        gets ``rand_noise[:, :, :T]``, so a padded item of length T_i sees exactly the official
        ``rand_noise[:, :, :T_i]`` on its valid frames. ``estimator_fn`` replaces the local estimator (e.g. an
        ONNX session or a remote model); ``streaming`` selects chunk-causal attention in the estimator.
        """
        n = self.config.n_timesteps if n_timesteps is None else n_timesteps
        z = self.noise(mu.shape[-1]) if noise is None else noise
        z = z.to(device=mu.device, dtype=mu.dtype).expand_as(mu) * temperature
        fn = estimator_fn or self.estimator
        return solve_euler(fn, z, mask, mu, spks, cond, self.t_span(n, mu.device, mu.dtype),
                           self.config.inference_cfg_rate, streaming)
