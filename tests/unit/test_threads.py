"""The library's thread count and spinning (:mod:`cosyvoice_triton.threads`): the rule, the overrides, the machine's
facts, and the settings reaching torch and the onnxruntime sessions the library creates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cosyvoice_triton import threads as th
from cosyvoice_triton.errors import ConfigError
from cosyvoice_triton.threads import Machine, decide

SPIN = "session.intra_op.allow_spinning"


@pytest.fixture
def torch_threads():
    """Give torch's count and the library's memory of it back after the test."""
    before, applied = torch.get_num_threads(), th._applied
    yield
    torch.set_num_threads(before)
    th._applied = applied


# -- the rule ------------------------------------------------------------------------------------------------------

def test_busy_neighbours_give_one_thread_without_spinning():
    c = decide(Machine(cpus_allowed=2, host_cpus=2, load=9.5))
    assert (c.threads, c.spinning, c.set_torch, c.source) == (1, False, True, "auto")
    assert c.free_cores == 0 and "load average 9.50" in c.reason and "2 CPU(s) allowed" in c.reason


def test_a_quiet_machine_gives_every_core_and_spinning():
    c = decide(Machine(cpus_allowed=8, host_cpus=8, load=0.1))
    assert (c.threads, c.spinning) == (8, True)
    assert decide(Machine(cpus_allowed=8, host_cpus=8, load=None)).threads == 8  # no load average: none assumed


@pytest.mark.parametrize("load, want", [(0.0, 2), (0.2, 2), (0.3, 1), (1.0, 1), (1.3, 1), (30.0, 1)])
def test_a_core_is_free_while_others_use_at_most_the_slack(load, want):
    assert decide(Machine(cpus_allowed=2, host_cpus=2, load=load)).threads == want


def test_this_process_share_of_the_load_is_not_a_neighbour():
    assert decide(Machine(cpus_allowed=2, host_cpus=2, load=2.0, own_load=2.0)).threads == 2
    assert decide(Machine(cpus_allowed=2, host_cpus=2, load=2.0, own_load=1.0)).threads == 1


def test_a_cpu_quota_and_a_bigger_host():
    assert decide(Machine(cpus_allowed=16, host_cpus=16, quota=2.5, load=0.0)).threads == 2
    assert decide(Machine(cpus_allowed=16, host_cpus=16, quota=0.5, load=0.0)).threads == 1
    # the host's load spread over its 64 CPUs: 32 busy -> half of each of our 4 is taken
    c = decide(Machine(cpus_allowed=4, host_cpus=64, load=32.0))
    assert c.free_cores == pytest.approx(2.0) and c.threads == 2 and "scaled to 4 of 64 CPUs" in c.reason


def test_explicit_settings_win_in_order():
    busy = Machine(cpus_allowed=2, host_cpus=2, load=9.5)
    env = {"COSYVOICE_THREADS": "3", "OMP_NUM_THREADS": "5"}
    assert (decide(busy, threads=4, env=env).threads, decide(busy, threads=4, env=env).source) == (4, "argument")
    assert (decide(busy, env=env).threads, decide(busy, env=env).source) == (3, "COSYVOICE_THREADS")
    c = decide(busy, env={"OMP_NUM_THREADS": "5"})
    assert (c.threads, c.source, c.set_torch) == (5, "OMP_NUM_THREADS", False)
    c = decide(busy, torch_user_threads=6)
    assert (c.threads, c.source, c.set_torch) == (6, "torch.set_num_threads", False)
    c = decide(busy, env={"COSYVOICE_THREADS": "auto"}, torch_user_threads=None)
    assert (c.threads, c.source) == (1, "auto")
    for bad in ({"COSYVOICE_THREADS": "0"}, {"COSYVOICE_THREADS": "two"}, {"COSYVOICE_SPINNING": "maybe"}):
        with pytest.raises(ConfigError, match="COSYVOICE_"):
            decide(busy, env=bad)
    with pytest.raises(ConfigError, match="threads"):
        decide(busy, threads=0)


def test_spinning_follows_free_cores_unless_told():
    quiet = Machine(cpus_allowed=2, host_cpus=2, load=0.0)
    assert decide(quiet).spinning and not decide(quiet, threads=4).spinning  # 4 threads, 2 cores: no spinning
    assert not decide(quiet, threads=1).spinning  # one thread: no pool
    busy = Machine(cpus_allowed=2, host_cpus=2, load=9.5)
    assert decide(busy, spinning=True).spinning and not decide(quiet, spinning=False).spinning
    assert decide(busy, env={"COSYVOICE_SPINNING": "on"}).spinning
    assert not decide(quiet, env={"OMP_WAIT_POLICY": "PASSIVE"}).spinning
    assert decide(busy, env={"OMP_WAIT_POLICY": "active"}).spinning


# -- the machine's facts -------------------------------------------------------------------------------------------

def test_cgroup_quota_files(tmp_path):
    assert th.parse_cpu_max("max 100000\n") is None and th.parse_cpu_max("150000 100000") == 1.5
    assert th.parse_cfs("-1", "100000") is None and th.parse_cfs("200000\n", "100000\n") == 2.0
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "a" / "cpu.max").write_text("300000 100000\n")  # a parent's limit binds its children
    (v2 / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert th.cgroup_quota(v2, proc) == 3.0
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "box").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "box" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu,cpuacct" / "box" / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("4:memory:/box\n3:cpu,cpuacct:/box\n")
    assert th.cgroup_quota(v1, proc) == 0.5
    proc.write_text("")
    assert th.cgroup_quota(v1, proc) is None and th.cgroup_quota(v1, tmp_path / "missing") is None


def test_own_load_is_the_cpu_rate_as_the_load_average_takes_it_in(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + ["0"] * 50
    fields[11], fields[12], fields[19] = str(30 * tick), str(0), str(100 * tick)  # 30 s CPU, started at 100 s
    stat, uptime = tmp_path / "stat", tmp_path / "uptime"
    stat.write_text("123 (python (x)) " + " ".join(fields))
    uptime.write_text("160.0 1.0\n")  # 60 s old, one core busy half the time
    assert th.own_load(stat, uptime) == pytest.approx(0.5 * (1 - 2.718281828 ** -1), rel=1e-6)
    assert th.own_load(tmp_path / "none", uptime) == 0.0
    assert 0.0 <= th.own_load() < 64  # this process, read from /proc


# -- the settings reaching torch and onnxruntime -------------------------------------------------------------------

def test_configure_sets_torch_and_a_later_choice_keeps_it(torch_threads):
    c = th.configure(3)
    assert torch.get_num_threads() == 3 and c.source == "argument"
    assert th.choose(env={}).threads == 3  # an explicit count holds for later entry points
    torch.set_num_threads(2)  # the user changes it: left alone
    again = th.choose(env={})
    assert (again.threads, again.source, again.set_torch) == (2, "torch.set_num_threads", False)
    th.apply_torch(again)
    assert torch.get_num_threads() == 2


def test_from_pretrained_applies_the_choice_to_torch_and_the_sessions(tmp_path, torch_threads):
    from cosyvoice_triton.models.demo import write_demo_model
    from cosyvoice_triton.pipeline import CosyVoice2

    d = write_demo_model(tmp_path / "tiny", size="tiny", seed=0)
    for spinning in (True, False):
        model = CosyVoice2.from_pretrained(d, threads=1, spinning=spinning, tts=False)
        assert torch.get_num_threads() == 1 and model.thread_choice.threads == 1
        assert model.thread_choice.spinning is spinning
        for session in (model.tokenizer.session, model.speaker.session):
            assert session.get_session_options().get_session_config_entry(SPIN) == ("1" if spinning else "0")


def test_the_lm_kernels_take_the_spinning_setting():
    import numpy as np

    from cosyvoice_triton.models.lm_ort import OrtKernel

    w = np.ones((3, 4), np.float32)
    for spinning in (True, False):
        kernel = OrtKernel(w, threads=1, spinning=spinning)
        assert kernel.session.get_session_options().get_session_config_entry(SPIN) == ("1" if spinning else "0")


def test_prepare_environment_sets_the_wait_policy_only_before_torch(monkeypatch):
    monkeypatch.setattr(th, "machine", lambda: Machine(cpus_allowed=2, host_cpus=2, load=9.5))
    env: dict[str, str] = {}
    assert th.prepare_environment(environ=env) is None and env == {}  # torch is imported here: too late
    monkeypatch.delitem(sys.modules, "torch")
    choice = th.prepare_environment(environ=env)
    assert choice is not None and not choice.spinning and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "1000"}
    th.prepare_environment(environ=env)
    assert env == {"GOMP_SPINCOUNT": "1000"}  # the user's setting stays
    env = {}
    th.prepare_environment(spinning=True, environ=env)
    assert env == {}  # spinning: the runtime's default
    assert th.openmp_wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}).startswith("sleep")
    assert th.openmp_wait_policy({}).startswith("spin a while")


def test_the_command_line_sets_the_wait_policy_before_torch_loads():
    """``cosyvoice-triton`` decides before any torch import: a bench-* command, told not to spin, starts torch with
    ``OMP_WAIT_POLICY=PASSIVE`` in its environment (libgomp reads it only then)."""
    code = ("import os, sys\n"
            "import cosyvoice_triton.__main__ as cli\n"
            "cli.run_passthrough = lambda target, argv, prog: print('torch' in sys.modules,\n"
            "                                                      os.environ.get('OMP_WAIT_POLICY'))\n"
            "cli.main(['bench-neighbour', '--help'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "COSYVOICE_SPINNING": "0"}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "PASSIVE"]
