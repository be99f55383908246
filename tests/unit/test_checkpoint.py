"""Loading official checkpoint files: key spellings, revisions and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cosyvoice_triton.errors import CheckpointError
from cosyvoice_triton.models.checkpoint import (
    CAUSAL_FLOW_KEY,
    LEGACY_FLOW_KEY,
    check_flow_revision,
    load_into,
    normalize_keys,
    read_state_dict,
)


def test_missing_empty_and_corrupt_files(tmp_path):
    with pytest.raises(CheckpointError, match="flow.pt: file not found"):
        read_state_dict(tmp_path / "flow.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.pt: file is empty"):
        read_state_dict(tmp_path / "empty.pt")
    (tmp_path / "junk.pt").write_bytes(b"this is not a zip archive" * 10)
    with pytest.raises(CheckpointError, match="junk.pt: not a readable PyTorch checkpoint"):
        read_state_dict(tmp_path / "junk.pt")
    good = tmp_path / "good.pt"
    torch.save({"a.weight": torch.ones(3)}, good)
    (tmp_path / "trunc.pt").write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="trunc.pt"):
        read_state_dict(tmp_path / "trunc.pt")


def test_not_a_state_dict(tmp_path):
    torch.save(torch.zeros(3), tmp_path / "t.pt")
    with pytest.raises(CheckpointError, match="expected a state_dict"):
        read_state_dict(tmp_path / "t.pt")
    torch.save({}, tmp_path / "e.pt")
    with pytest.raises(CheckpointError, match="e.pt: expected a state_dict .*, got an empty dict"):
        read_state_dict(tmp_path / "e.pt")
    torch.save({"a": 1}, tmp_path / "d.pt")
    with pytest.raises(CheckpointError, match="entry 'a' is a int"):
        read_state_dict(tmp_path / "d.pt")


def test_pickled_code_is_refused(tmp_path):
    torch.save({"m": nn.Linear(2, 2)}, tmp_path / "m.pt")  # a module object, not tensors
    with pytest.raises(CheckpointError, match="m.pt: holds pickled objects other than tensors"):
        read_state_dict(tmp_path / "m.pt")


def test_half_precision_is_widened(tmp_path):
    torch.save({"w": torch.ones(2, dtype=torch.float16), "i": torch.ones(2, dtype=torch.int64)}, tmp_path / "h.pt")
    sd = read_state_dict(tmp_path / "h.pt")
    assert sd["w"].dtype == torch.float32 and sd["i"].dtype == torch.int64


def test_key_spellings_are_normalised():
    sd = {
        "generator.conv_pre.weight_g": torch.ones(1),
        "generator.conv_pre.weight_v": torch.ones(1),
        "m_source.l_linear.weight": torch.ones(1),
        "resblocks.0.convs1.0.parametrizations.weight.original0": torch.ones(1),
    }
    assert sorted(normalize_keys(sd)) == [
        "conv_pre.parametrizations.weight.original0",
        "conv_pre.parametrizations.weight.original1",
        "m_source.l_linear.weight",
        "resblocks.0.convs1.0.parametrizations.weight.original0",
    ]


def test_flow_revision_check():
    check_flow_revision({CAUSAL_FLOW_KEY: torch.ones(1)}, "flow.pt")
    with pytest.raises(CheckpointError, match="pre-2025 CosyVoice2 release"):
        check_flow_revision({LEGACY_FLOW_KEY: torch.ones(1)}, "flow.pt")
    with pytest.raises(CheckpointError, match="not a CosyVoice2 flow checkpoint"):
        check_flow_revision({"conv_pre.bias": torch.ones(1)}, "hift.pt")


def test_load_into_reports_mismatches():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    load_into(model, state, "ok.pt")
    bad = dict(state)
    bad.pop("1.bias")
    bad["2.weight"] = torch.ones(1)
    bad["0.weight"] = torch.ones(5, 4)
    with pytest.raises(CheckpointError) as info:
        load_into(model, bad, "bad.pt")
    msg = str(info.value)
    assert "bad.pt" in msg and "1 missing (e.g. 1.bias)" in msg and "1 unexpected (e.g. 2.weight)" in msg
    assert "0.weight: file (5, 4) vs model (3, 4)" in msg
