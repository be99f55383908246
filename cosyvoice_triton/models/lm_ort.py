"""``lm_precision fp32-ort``: the LM's Linear layers in fp32 through onnxruntime's MatMul, the rest unchanged.

Every ``nn.Linear`` of the Qwen2 trunk (q/k/v/o projections, the MLP's gate/up/down) becomes an
:class:`OrtLinear`: a one-layer onnxruntime session ``y = x @ W (+ b)`` (MatMul, then Add where the layer has a
bias) with that layer's own weights. The embeddings, the norms, RoPE, attention over transformers' KV cache and the
speech head ``llm_decoder`` stay PyTorch, so batching (:class:`~.llm.BatchDecoder`, the served LM engine), live
decoding (:mod:`.bistream`) and sampling run as they do in fp32. It is the same arithmetic in another GEMM
library: the log-probabilities equal fp32's to float32 rounding (tests/unit/test_lm_ort.py, tiny dims: within 1e-5
on the prefill and the decode steps, the same tokens under the same draws). Why: ``bench-lm-kernels`` measured
onnxruntime's fp32 MatMul at 58 % of ``nn.Linear``'s time at batch 1 and 27 % at batch 8 on the trunk's layers
(docs/benchmarks.md); ``bench-tts`` measures what that leaves of a whole decode step.

The head stays ``nn.Linear``: it is 1.6 % of the multiply-adds at CosyVoice2-0.5B dims, and its ``weight`` is
where the LM's code reads its device.

Weights: each session is built in memory (no file). The graph declares ``W`` as an external initializer and the
session gets it from a NumPy array (``SessionOptions.add_external_initializers``), so the weights are never
serialised into protobuf (a model with the weights inside kept about twice the weights' memory: the parsed graph's
copy next to the session's). onnxruntime 1.32 takes ``W`` into its own memory when the session is created (its CPU
MatMul packs a constant ``W`` into its GEMM layout) and does not read the array again; :class:`OrtKernel` checks
that (the array is overwritten with NaN and probes of 1 and 3 rows must give the same outputs) and then frees the
array, so the trunk's weights are held once, by onnxruntime. (Were a build to read the array still, the check
fails and the array is kept: twice the memory, the same results.) The ``nn.Linear`` weights go with the swapped
modules, and the freed heap is handed back to the OS. Measured at full dims (CosyVoice2-0.5B's LM, random
weights, onnxruntime 1.32): resident memory after loading 2.3 GB in fp32, 2.5 GB in fp32-ort (the packed weights'
padding and the sessions); the peak while loading is the checkpoint's, the same for both (4.2 GB); loading took
22-26 s against 9-22 s for fp32 (168 sessions; a loaded 2-core machine).

Threads: ``threads`` intra-op threads per session, by default torch's thread count when the LM is built
(:func:`torch.get_num_threads`): 1 in the served models, whose ``torch_threads`` (default 1) is set before the
LM loads, and in process what PyTorch's fp32 LM would use, so the two precisions compare on the same threads.
Each session has its own pool (``threads - 1`` workers, none at 1 thread); the 168 sessions of the full trunk
run one after another, so the pools' workers do not spin (``session.intra_op.allow_spinning`` 0): a spinning
pool keeps a core busy after its layer, while the next layer's pool and PyTorch's threads want it. Measured on
the 2-core development machine under heavy outside load (load average 33-57; indicative only): one batch-1 pass
through 84 full-dims trunk Linears at 2 threads took 49 ms at best without spinning and 1.5 s with it, and a
1-thread pass run right after the spinning sessions slowed from about 0.1 s to 0.8 s.

Log-probabilities at full dims (random weights, 19 teacher-forced steps): fp32-ort against fp32 differ by at most
1.6e-5 on the 25 most likely tokens (2.0e-5 over the vector), fp32 against itself at 1 and 2 threads by 0.9e-5
(1.3e-5), and fp32 alone against fp32 in a batch of 2 by 0.9e-5 (1.6e-5): float32 rounding of the same sums.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..threads import ort_spinning

__all__ = ["PRECISION", "OrtKernel", "OrtLinear", "linear_model", "ort_linears", "ort_lm"]

#: The ``lm_precision`` of this module.
PRECISION = "fp32-ort"


def linear_model(in_features: int, out_features: int, bias: np.ndarray | None = None,
                 weight_t: np.ndarray | None = None) -> bytes:
    """A one-layer ONNX model ``y = x @ w (+ b)``: input ``x`` [rows, in] float32 with a dynamic row count,
    ``w`` [in, out] (the transpose of ``nn.Linear.weight``), MatMul, then Add when ``bias``.

    ``weight_t`` given: ``w`` is stored in the model (for tools that read a self-contained model: the quantisers
    of ``bench-lm-kernels``). Otherwise ``w`` is declared external and must be supplied when the session is
    created (:class:`OrtKernel`)."""
    from onnx import TensorProto, helper, numpy_helper

    if weight_t is not None:
        if weight_t.shape != (in_features, out_features):
            raise ValueError(f"weight_t must be [in, out] = [{in_features}, {out_features}], got {weight_t.shape}")
        w = numpy_helper.from_array(np.ascontiguousarray(weight_t, np.float32), "w")
    else:
        w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[in_features, out_features],
                        data_location=TensorProto.EXTERNAL)
        for key, value in (("location", "in-memory"), ("offset", "0"), ("length", str(4 * in_features * out_features))):
            entry = w.external_data.add()
            entry.key, entry.value = key, value
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y" if bias is None else "xw"])]
    inits = [w]
    if bias is not None:
        nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
        inits.append(numpy_helper.from_array(np.ascontiguousarray(bias, np.float32).reshape(out_features), "b"))
    graph = helper.make_graph(nodes, "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", in_features])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", out_features])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def _probes(in_features: int) -> list[np.ndarray]:
    """Inputs of 1 and 3 rows (a decode step at batch 1, a batch or a prompt)."""
    g = np.random.default_rng(0)
    return [g.standard_normal((rows, in_features)).astype(np.float32) for rows in (1, 3)]


class OrtKernel:
    """``x -> x @ weight.T + bias`` on onnxruntime's CPU MatMul (``weight`` [out, in] float32 as ``nn.Linear``
    holds it; ``x`` [rows, in] float32). Thread-safe (onnxruntime sessions are); see the module docstring for
    ``threads``, spinning and where the weights live (:attr:`holds_weight_copy`)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None = None, *, threads: int = 1,
                 spinning: bool = False):
        import onnxruntime as ort

        weight = np.asarray(weight, np.float32)
        if weight.ndim != 2:
            raise ValueError(f"weight must be [out, in], got shape {weight.shape}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.out_features, self.in_features = weight.shape
        self.threads, self.spinning = int(threads), bool(spinning)
        w = np.ascontiguousarray(weight.T)  # [in, out]: a copy this object owns
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = self.threads, 1
        ort_spinning(options, spinning)
        value = ort.OrtValue.ortvalue_from_numpy(w)
        options.add_external_initializers(["w"], [value])
        model = linear_model(self.in_features, self.out_features, None if bias is None else np.asarray(bias))
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        del options
        # Does the session still read ``w``? (onnxruntime takes a constant MatMul weight in at creation.)
        probes = _probes(self.in_features)
        before = [self(x) for x in probes]
        w.fill(np.nan)
        after = [self(x) for x in probes]
        if all(np.array_equal(a, b) and np.isfinite(b).all() for a, b in zip(before, after, strict=True)):
            self._weight: tuple | None = None  # packed by onnxruntime: ours is freed
        else:
            np.copyto(w, weight.T)
            self._weight = (w, value)  # the session reads it: kept for its lifetime

    @property
    def holds_weight_copy(self) -> bool:
        """Whether this kernel keeps its own copy of the weights next to onnxruntime's (False when onnxruntime
        packed them: the weights are held once)."""
        return self._weight is not None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"x": x})[0]


class OrtLinear(nn.Module):
    """An ``nn.Linear`` computed by an :class:`OrtKernel` (inference only, CPU, float32 out), or by ``kernel``
    (``x [rows, in] float32 -> [rows, out]``, with the layer's dims and whether it has a bias). It holds no
    parameters (its weights live in the session); ``copy.deepcopy`` shares the kernel, whose weights are
    read-only."""

    def __init__(self, linear: nn.Linear | None = None, *, threads: int = 1, spinning: bool = False,
                 kernel: Callable[[np.ndarray], np.ndarray] | None = None, in_features: int = 0,
                 out_features: int = 0, has_bias: bool = False):
        super().__init__()
        if kernel is None:
            if linear is None:
                raise ValueError("OrtLinear needs an nn.Linear (or a kernel with its dims)")
            bias = None if linear.bias is None else linear.bias.detach().cpu().float().numpy()
            kernel = OrtKernel(linear.weight.detach().cpu().float().numpy(), bias, threads=threads, spinning=spinning)
        if linear is not None:
            in_features, out_features, has_bias = linear.in_features, linear.out_features, linear.bias is not None
        self.in_features, self.out_features, self.has_bias = in_features, out_features, has_bias
        self.run = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).contiguous().numpy()
        return torch.from_numpy(self.run(flat)).reshape(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo) -> OrtLinear:
        twin = type(self).__new__(type(self))
        nn.Module.__init__(twin)
        for key, value in self.__dict__.items():  # the kernel and plain attributes, shared
            twin.__dict__.setdefault(key, value)
        twin.training = self.training
        memo[id(self)] = twin
        return twin

    def extra_repr(self) -> str:
        threads = getattr(self.run, "threads", None)
        return f"in_features={self.in_features}, out_features={self.out_features}" + \
            (f", threads={threads}" if threads is not None else "")


def ort_linears(module: nn.Module, *, threads: int = 1, spinning: bool = False,
                make: Callable[[nn.Linear], nn.Module] | None = None) -> nn.Module:
    """Every ``nn.Linear`` under ``module`` replaced, in place, by an :class:`OrtLinear` (``make``: another
    replacement per layer). Each replaced Linear is dropped at once (unless something else holds it), so at most
    one layer's weights are held twice while this runs. Returns ``module``."""
    make = make or (lambda linear: OrtLinear(linear, threads=threads, spinning=spinning))
    for name in list(module._modules):  # names only: no list that keeps the replaced layers alive
        child = module._modules[name]
        if type(child) is nn.Linear:
            setattr(module, name, make(child))
        elif child is not None:
            ort_linears(child, make=make)
        del child
    return module


def ort_lm(lm, *, threads: int | None = None, spinning: bool = False):
    """``lm`` (a :class:`~.llm.Qwen2LM` in eval mode, on the CPU) with its Qwen2 trunk's Linear layers on
    onnxruntime, in place; ``threads``: intra-op threads per layer (None: :func:`torch.get_num_threads`).
    Returns ``lm``."""
    device = lm.llm_decoder.weight.device
    if device.type != "cpu":
        raise ConfigError(f"lm_precision {PRECISION} is onnxruntime's CPU MatMul; the LM is on {device}: use fp32 "
                          "there (on a GPU the LM is served by TensorRT-LLM)")
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ConfigError(f"lm_precision {PRECISION}: threads must be >= 1, got {threads}")
    ort_linears(lm.qwen, threads=threads, spinning=spinning)
    lm.lm_precision, lm.lm_threads = PRECISION, threads
    _trim_heap()
    return lm


def _trim_heap() -> None:
    """Hand the freed heap back to the OS (glibc's ``malloc_trim``; elsewhere nothing): glibc keeps the pages of
    the replaced Linear weights mapped after they are freed (at full dims about 0.9 GB of resident memory)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
