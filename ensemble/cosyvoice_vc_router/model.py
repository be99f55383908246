"""Triton Python-backend router of ``cosyvoice_vc`` in a versioned repository (BLS): each request goes on, as it
is, to the pipeline of one version (``cosyvoice_vc_v<N>``) picked by the split of the config's ``parameters``
(:class:`cosyvoice_triton.serving.launch.rollout.Split`), by one synchronous BLS call: requests run concurrently in the
model's instances. A request whose
version's pipeline is gone (being unloaded by a promote or rollback while this instance is being replaced) goes to
another version of the split instead. A version of ``seedless_versions`` (CosyVoice3: its vocoder noise is the
checkpoint's fixed buffer, nothing to seed) gets the request without its ``seed`` input and parameter."""

import json

import triton_python_backend_utils as pb_utils

from cosyvoice_triton.serving.launch.rollout import ROUTER_PARAMS, Split, pipeline_gone
from cosyvoice_triton.serving.stages.params import read_parameters
from cosyvoice_triton.shapes import VC_INPUTS, VC_OPTIONAL_INPUTS

INPUTS = [t.name for t in (*VC_INPUTS, *VC_OPTIONAL_INPUTS)]


class TritonPythonModel:
    def initialize(self, args):
        p = read_parameters(args["model_config"], ROUTER_PARAMS, model=args["model_name"])
        self.split = Split.parse(p["split"]).start_anywhere()  # instances begin at different points of the cycle
        self.target, self.timeout = p["target"], p["bls_timeout_us"]
        self.seedless = {int(v) for v in p["seedless_versions"].split(",") if v.strip()}

    def execute(self, requests):
        return [self.forward(r) for r in requests]

    def forward(self, request):
        inputs = [t for name in INPUTS if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None]
        timeout = {"timeout": self.timeout} if self.timeout else {}
        parameters = json.loads(request.parameters() or "{}")
        outputs = sorted(request.requested_output_names())
        first = self.split.choose()
        for version in (first, *(v for v in self.split.weights if v != first)):  # the others: only if it is gone
            model = self.target.format(version=version)
            sent, params = inputs, parameters
            if version in self.seedless:
                sent = [t for t in inputs if t.name() != "seed"]
                params = {k: v for k, v in parameters.items() if k != "seed"}
            kwargs = {**timeout, **({"parameters": params} if params else {})}
            res = pb_utils.InferenceRequest(model_name=model, inputs=sent, requested_output_names=outputs,
                                            **kwargs).exec()
            if not res.has_error() or not pipeline_gone(res.error().message(), model):
                break
        if res.has_error():
            err = res.error()
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(err.message(), err.code()))
        return pb_utils.InferenceResponse(output_tensors=res.output_tensors())
