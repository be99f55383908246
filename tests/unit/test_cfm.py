"""Euler/CFG solver and the fixed noise: per-step estimator parity and full-flow parity with the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import FEAT_BAR, flow_oracle_script, rel_err
from test_estimator import TINY, load_tiny_estimator, random_inputs

from cosyvoice_triton.config import CFMConfig
from cosyvoice_triton.models.cfm import CausalConditionalCFM, cfm_noise, cosine_t_span, solve_euler
from cosyvoice_triton.models.estimator import CausalConditionalDecoder

CASES = ["flow_nonstream", "flow_vc_misaligned", "flow_stream_chunk", "flow_stream_final"]


@pytest.fixture(scope="module")
def tiny_cfm(tiny_dir) -> CausalConditionalCFM:
    return CausalConditionalCFM(load_tiny_estimator(tiny_dir), CFMConfig())


def tensors(ref, *keys):
    return [torch.from_numpy(ref[k]) for k in keys]


def test_cfm_noise_is_the_official_buffer(flow_oracle_meta):
    state = torch.get_rng_state()
    noise = cfm_noise()
    assert torch.equal(torch.get_rng_state(), state), "cfm_noise must not touch the global RNG"
    assert noise.shape == (1, 80, 15000) and noise.dtype == torch.float32
    assert flow_oracle_script().sha256(noise) == flow_oracle_meta["cfm_rand_noise_sha256"]


def test_cfm_noise_matches_external_reference(external_tiny_dir):
    assert np.array_equal(cfm_noise().numpy(), np.load(external_tiny_dir / "cfm_rand_noise.npy"))


@pytest.mark.parametrize("case", CASES)
def test_t_span_and_noise_slice(tiny_cfm, ref_npz, case):
    ref = ref_npz(case)
    assert np.array_equal(cosine_t_span(10).numpy(), ref["t_span"])
    assert flow_oracle_script().sha256(tiny_cfm.noise(ref["mu"].shape[-1])) == str(ref["z0_sha256"])


@pytest.mark.parametrize("case", CASES)
def test_every_euler_step_estimator(tiny_cfm, ref_npz, case):
    ref = ref_npz(case)
    mu, mask, spks, cond = tensors(ref, "mu", "mask", "spks", "cond")
    streaming = bool(ref["streaming"])
    assert len(ref["est_steps"]) >= 2 and len(ref["est_t"]) == 10
    with torch.no_grad():
        for j, k in enumerate(ref["est_steps"].tolist()):  # the Euler steps the oracle kept
            x = torch.from_numpy(ref["est_x"][j : j + 1])
            out = tiny_cfm.estimator(torch.cat([x, x]), torch.cat([mask, mask]),
                                     torch.cat([mu, torch.zeros_like(mu)]),
                                     torch.from_numpy(ref["est_t"][k : k + 1]).expand(2),
                                     torch.cat([spks, torch.zeros_like(spks)]),
                                     torch.cat([cond, torch.zeros_like(cond)]), streaming)
            assert rel_err(out.numpy(), ref["est_out"][j]) <= 1e-5, f"step {k}"


@pytest.mark.parametrize("case", CASES)
def test_full_solver_matches_flow_feat(tiny_cfm, ref_npz, case):
    ref = ref_npz(case)
    mu, mask, spks, cond = tensors(ref, "mu", "mask", "spks", "cond")
    seen_t = []

    def fn(x, mask, mu, t, spks, cond, streaming):
        seen_t.append(t[0].item())
        return tiny_cfm.estimator(x, mask, mu, t, spks, cond, streaming)

    out = tiny_cfm(mu, mask, spks, cond, n_timesteps=int(ref["n_timesteps"]),
                   temperature=float(ref["temperature"]), streaming=bool(ref["streaming"]), estimator_fn=fn)
    feat = ref["feat"]
    assert np.array_equal(np.float32(seen_t), ref["est_t"])
    assert out.dtype == torch.float32
    assert rel_err(out[:, :, mu.shape[-1] - feat.shape[-1] :].numpy(), feat) <= FEAT_BAR


def test_cfg_layout_and_update_rule():
    """A fake estimator: cond rows return a, uncond rows b, so x_T = z + (1.7 a - 0.7 b) (sum of dt = 1)."""
    b, t = 3, 7
    z, mu, cond = torch.randn(b, 80, t), torch.randn(b, 80, t) + 5, torch.randn(b, 80, t) + 5
    spks, mask = torch.randn(b, 80) + 5, torch.ones(b, 1, t)
    a = torch.arange(b, dtype=torch.float32).view(b, 1, 1) + 1
    calls = []

    def fn(x, m, mu_in, t_in, spks_in, cond_in, streaming):
        calls.append(streaming)
        assert x.shape == (2 * b, 80, t) and t_in.shape == (2 * b,)
        assert torch.equal(x[:b], x[b:]) and torch.equal(mu_in[:b], mu) and torch.equal(spks_in[:b], spks)
        assert torch.equal(cond_in[:b], cond) and not mu_in[b:].any() and not spks_in[b:].any()
        assert not cond_in[b:].any() and torch.equal(m, torch.cat([mask, mask]))
        return torch.cat([a.expand(b, 80, t), -2 * a.expand(b, 80, t)])

    out = solve_euler(fn, z, mask, mu, spks, cond, cosine_t_span(10), 0.7, streaming=True)
    assert calls == [True] * 10
    torch.testing.assert_close(out, z + (1.7 * a + 1.4 * a), rtol=1e-6, atol=1e-5)


def test_padded_batch_equals_per_item():
    torch.manual_seed(2)
    est = CausalConditionalDecoder(TINY).eval()
    cfm = CausalConditionalCFM(est, CFMConfig(noise_frames=400))
    lengths = [90, 53]
    batch = random_inputs(2, 90, lengths, seed=5)
    for streaming in (False, True):
        args = (batch["mu"], batch["mask"], batch["spks"], batch["cond"])
        out = cfm(*args, n_timesteps=4, streaming=streaming)
        for i, n in enumerate(lengths):
            one = cfm(batch["mu"][i:i + 1, :, :n], batch["mask"][i:i + 1, :, :n], batch["spks"][i:i + 1],
                      batch["cond"][i:i + 1, :, :n], n_timesteps=4, streaming=streaming)
            assert rel_err(out[i:i + 1, :, :n].numpy(), one.numpy()) <= 1e-5


def test_injected_noise_and_temperature():
    torch.manual_seed(3)
    cfm = CausalConditionalCFM(CausalConditionalDecoder(TINY).eval(), CFMConfig(noise_frames=100))
    inp = random_inputs(1, 30, [30])
    args = (inp["mu"], inp["mask"], inp["spks"], inp["cond"])
    default = cfm(*args, n_timesteps=2, temperature=0.5)
    injected = cfm(*args, n_timesteps=2, temperature=0.5, noise=cfm.rand_noise[:, :, :30].clone())
    assert torch.equal(default, injected)
    assert not torch.equal(default, cfm(*args, n_timesteps=2, noise=torch.zeros(1, 80, 30)))
    with pytest.raises(ValueError, match="noise buffer"):
        cfm.noise(101)
    assert "rand_noise" not in cfm.state_dict()


def test_zero_steps_is_a_clear_error():
    cfm = CausalConditionalCFM(CausalConditionalDecoder(TINY).eval(), CFMConfig(noise_frames=100))
    inp = random_inputs(1, 30, [30])
    with pytest.raises(ValueError, match=r"t_span needs at least 2 points \(n_timesteps >= 1\), got 1"):
        cfm(inp["mu"], inp["mask"], inp["spks"], inp["cond"], n_timesteps=0)
