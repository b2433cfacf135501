"""Tensor Core alignment check for PyTorch modules (and LightningModules): torch shape capture.

:func:`check_alignment` runs one forward and backward pass of a sample batch under a
``TorchDispatchMode`` and records every aten op that can run on Tensor Cores (``mm``, ``addmm``,
``bmm``, ``baddbmm``, ``convolution`` and its backward, the fused attention ops, ``lstm``/``gru``/``rnn``)
with its shapes and dtype. Because it sees the *executed* ops, a weight used through a raw ``x @ w`` in a
custom module is found like an ``nn.Linear``.

Attribution: forward ops go to the innermost module whose forward is running (forward pre/post hooks).
Each module's post-hook also labels the autograd nodes its forward created (``Node.metadata``, bounded
by the autograd sequence number at the pre-hook), so backward ops, which run outside every forward,
are attributed through ``torch._C._current_autograd_node()``.

Precision: on a CUDA device a ``dtype`` of float16/bfloat16 runs the pass under ``torch.autocast``. On
the CPU or the meta device the pass runs in float32 and the ops autocast would run in 16 bits are
recorded with that dtype ("simulated autocast"): CPU kernels for float16 are slow or missing, and only
shapes matter here. Host syncs: none beyond the pass itself; the check is meant for train start.

The model's state is left as found: gradients are taken with ``torch.autograd.grad`` (``.grad`` is never
touched), buffers (BatchNorm statistics) are restored, and the pass runs on a fork of the random number
generators (dropout in the pass does not shift the random stream of the training that follows).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(50, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    >>> report = check_alignment(model, torch.zeros(32, 50), dtype="float16")
    >>> [(f.layer, f.dimension, f.value, f.severity, f.suggested) for f in report.findings]
    [('0', 'features_in', 50, 'high', 56)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lossscale_callbacks.alignment import AlignmentReport, analyze
from lossscale_callbacks.integration import (
    Capture,
    FrameworkAdvice,
    LayerInfo,
    LayerPrecision,
    ModelDim,
    OpPrecision,
    OpRecord,
    Pass,
    PrecisionInfo,
    Role,
    get_target,
    warn_if_nothing_checked,
)

__all__ = ["capture", "check_alignment"]

_LABEL = "lossscale_callbacks.module"
_DTYPE_ALIASES = {
    "auto": "auto",
    "float16": "float16", "fp16": "float16", "half": "float16", "16": "float16", "16-mixed": "float16",
    "16-true": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16",
    "float32": "float32", "fp32": "float32", "32": "float32", "32-true": "float32",
}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_GEMM_OPS = {"mm": (0, 1), "addmm": (1, 2), "_addmm_activation": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
_ATTENTION_OPS = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_efficient_attention_forward"}
_RNN_OPS = {"lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn"}
_RNN_GATES = {"lstm": 4, "gru": 3}
_NORM_TYPES = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)
# How torch fixes what the framework-free engine finds.
_ADVICE = FrameworkAdvice(
    arguments={Role.CHANNELS_IN: "in_channels", Role.CHANNELS_OUT: "out_channels"},
    fixes={"layout": "channels_last"},
    advice={
        "layout": "Use model.to(memory_format=torch.channels_last) and channels_last inputs.",
        "dtype": "Check in the dtype you train in (dtype='float16' or 'bfloat16' under torch.autocast), or "
                 "allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True).",
        "variable_dtype": "Train under torch.autocast with float32 parameters instead of model.half().",
        "float16_normalization": "torch.autocast keeps normalisation in float32: use it instead of casting "
                                 "the model.",
        "float16_softmax": "Compute it outside autocast, on the output's .float().",
        "float16_loss": "Compute the loss outside autocast, on the output's .float().",
    })


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return str(dtype).replace("torch.", "")
    if dtype in (torch.int8, torch.uint8):
        return "int8"
    if "float8" in str(dtype):
        return "float8"
    return str(dtype).replace("torch.", "")


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


# ---- model dimensions ------------------------------------------------------------------------------


def _generic_dims(module: torch.nn.Module) -> tuple[ModelDim, ...]:
    """Every axis of the module's own 2-D+ parameters, orientation unknown."""
    dims = []
    for pname, param in module.named_parameters(recurse=False):
        shape = tuple(param.shape)
        if len(shape) < 2:
            continue
        for axis, size in enumerate(shape):
            others = math.prod(shape) // max(size, 1)
            dims.append(ModelDim(Role.FEATURES, size, lin_params=others, label=f"{pname}.shape[{axis}]"))
    return tuple(dims)


def _typed_dims(module: torch.nn.Module) -> tuple[ModelDim, ...] | None:
    """Model dimensions of the layer types whose GEMM mapping is known; ``None`` for other modules."""
    if isinstance(module, torch.nn.Linear):
        bias = 1 if module.bias is not None else 0
        return (ModelDim(Role.FEATURES_IN, module.in_features, lin_params=module.out_features,
                         label="in_features"),
                ModelDim(Role.FEATURES_OUT, module.out_features, lin_params=module.in_features + bias,
                         label="out_features"))
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return (ModelDim(Role.VOCAB, module.num_embeddings, lin_params=module.embedding_dim,
                         label="num_embeddings"),
                ModelDim(Role.EMBEDDING_DIM, module.embedding_dim, lin_params=module.num_embeddings,
                         label="embedding_dim"))
    if isinstance(module, torch.nn.MultiheadAttention):
        e, h, d = module.embed_dim, module.num_heads, module.head_dim
        bias = 1 if module.in_proj_bias is not None else 0
        return (ModelDim(Role.FEATURES_IN, e, quad_params=4, lin_params=4 * bias, label="embed_dim"),
                ModelDim(Role.FEATURES_OUT, e, gemm_values=(e, 3 * e), quad_params=4, lin_params=4 * bias,
                         label="embed_dim"),
                ModelDim(Role.HEAD_DIM, d, lin_params=4 * e * h + 3 * h * bias, label="head_dim"))
    if isinstance(module, torch.nn.RNNBase):
        gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
        hidden, inp, layers = module.hidden_size, module.input_size, module.num_layers
        dirs = 2 if module.bidirectional else 1
        nb = 2 if module.bias else 0
        quad = gates * dirs * (1 + (layers - 1) * (dirs + 1))
        lin = gates * dirs * (inp + nb) + (layers - 1) * gates * dirs * nb
        proj = getattr(module, "proj_size", 0)
        input_dim = ModelDim(Role.RNN_INPUT, inp, lin_params=gates * hidden * dirs, label="input_size")
        if proj:
            # With projections the state the recurrent GEMM reads (and upper layers take in) is
            # proj_size: W_hh is [gates*hidden, proj], W_hr is [proj, hidden].
            per_layer = gates * proj + nb * gates + proj  # W_hh, biases, W_hr per unit of hidden
            upper = (layers - 1) * dirs
            hidden_lin = dirs * (gates * inp + per_layer) + upper * (gates * dirs * proj + per_layer)
            proj_lin = dirs * layers * (gates * hidden + hidden) + upper * gates * hidden * dirs
            return (ModelDim(Role.RNN_HIDDEN, hidden, gemm_values=(hidden, gates * hidden),
                             lin_params=hidden_lin, label="hidden_size"),
                    ModelDim(Role.RNN_HIDDEN, proj, gemm_values=(proj, dirs * proj), lin_params=proj_lin,
                             label="proj_size"),
                    input_dim)
        # Upper layers of a bidirectional RNN read both directions: K = 2 * hidden.
        return (ModelDim(Role.RNN_HIDDEN, hidden, gemm_values=(hidden, gates * hidden, dirs * hidden),
                         quad_params=quad,
                         lin_params=lin, label="hidden_size"),
                input_dim)
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return ()  # convolutions carry their channels in the op itself
    return None


def _layer_infos(model: torch.nn.Module) -> tuple[dict[str, LayerInfo], tuple[ModelDim, ...]]:
    own: dict[int, tuple[ModelDim, ...]] = {}  # by module identity: a shared module has one name only
    global_dims: list[ModelDim] = []
    for _, module in model.named_modules():
        typed = _typed_dims(module)
        own[id(module)] = typed if typed is not None else _generic_dims(module)
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            global_dims.extend(own[id(module)])
    infos = {}
    for name, module in model.named_modules():
        fallback = tuple(d for sub in module.modules() if sub is not module for d in own.get(id(sub), ()))
        infos[name] = LayerInfo(name, type(module).__name__, own[id(module)], fallback)
    return infos, tuple(global_dims)


# ---- the recorder ----------------------------------------------------------------------------------


class _Recorder(TorchDispatchMode):
    """Records Tensor Core candidates and every op's dtype/category while the pass runs."""

    def __init__(self, simulate: str | None, tf32_matmul: bool, tf32_conv: bool) -> None:
        super().__init__()
        self.simulate = simulate
        self.tf32 = {"gemm": tf32_matmul, "conv": tf32_conv}
        self.records: list[OpRecord] = []
        self.ops: list[OpPrecision] = []
        self.softmax_outputs: list[tuple[int, torch.Tensor]] = []
        self.stack: list[tuple[str, int]] = []
        self.phase = Pass.FORWARD

    # attribution
    def _where(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get(_LABEL, ""), Pass.BACKWARD
        return (self.stack[-1][0] if self.stack else ""), Pass.FORWARD

    def _eff(self, dtype: torch.dtype, kind: str) -> str:
        name = _dtype_name(dtype)
        if name == "float32":
            if self.simulate:
                return self.simulate
            return "tfloat32" if self.tf32[kind] else "float32"
        return name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        layer, pass_ = self._where()
        try:
            self._record(name, args, layer, pass_, out)
        except (IndexError, AttributeError, TypeError, ValueError):
            pass  # an overload this parser does not know: it is simply not checked
        if self.phase == "quiet":
            return out  # our own default loss: not part of the user's model
        first = next(_tensors(out), None) if isinstance(out, (torch.Tensor, list, tuple)) else None
        if first is not None and first.is_floating_point():
            dtype = _dtype_name(first.dtype)
            tensor_core_op = (name in _GEMM_OPS or name in _ATTENTION_OPS or name in _RNN_OPS
                              or name.startswith("convolution"))
            if self.simulate and dtype == "float32" and tensor_core_op:
                dtype = self.simulate
            self.ops.append(OpPrecision(name, dtype, layer, pass_ if self.phase != "loss" else Pass.FORWARD,
                                        in_loss=self.phase == "loss"))
            if name in ("_softmax", "_log_softmax") and pass_ == Pass.FORWARD:
                self.softmax_outputs.append((len(self.ops) - 1, first))
        return out

    def _record(self, name: str, args: tuple, layer: str, pass_: str, out: Any = None) -> None:
        if name in _GEMM_OPS:
            ia, ib = _GEMM_OPS[name]
            a, b = args[ia], args[ib]
            dtype = self._eff(a.dtype, "gemm")
            m, k = a.shape[-2], a.shape[-1]
            self.records.append(OpRecord.gemm(name, layer, pass_, dtype, m=m, n=b.shape[-1], k=k,
                                              batch=max(a.numel() // max(m * k, 1), 1)))
        elif name == "convolution":
            self._conv(name, args[0], args[1], args[6], args[8], layer, (pass_,), out.numel())
        elif name == "convolution_backward":
            mask = args[10]
            grads = (Pass.INPUT_GRADIENT, Pass.WEIGHT_GRADIENT)
            passes = tuple(p for p, on in zip(grads, mask[:2], strict=True) if on)
            self._conv(name, args[1], args[2], args[7], args[9], layer, passes, args[0].numel())
        elif name in _ATTENTION_OPS or (name.endswith("_backward") and name[:-9] in _ATTENTION_OPS):
            q, k, v = (args[1], args[2], args[3]) if name.endswith("_backward") else args[:3]
            self._attention(name, q, k, v, layer, pass_)
        elif name in _RNN_OPS:
            self._rnn(name, args, layer, pass_)

    def _conv(self, name, inp, weight, transposed, groups, layer, passes, out_elems: int = 0) -> None:
        if inp.dim() < 3:
            return
        if transposed:
            in_ch, out_ch = weight.shape[0], weight.shape[1] * groups
        else:
            in_ch, out_ch = inp.shape[1], weight.shape[0]
        fmt = torch.channels_last if inp.dim() == 4 else torch.channels_last_3d if inp.dim() == 5 else None
        nhwc = fmt is not None and inp.is_contiguous(memory_format=fmt)
        layout = "NHWC" if nhwc or inp.shape[1] == 1 else "NCHW"
        dtype = self._eff(inp.dtype, "conv")
        for p in passes:
            self.records.append(OpRecord.conv(name, layer, p, dtype, in_channels=in_ch, out_channels=out_ch,
                                              groups=groups, kernel_elems=math.prod(weight.shape[2:]),
                                              layout=layout, output_elems=out_elems))

    def _attention(self, name, q, k, v, layer, pass_) -> None:
        dtype = self._eff(q.dtype, "gemm")
        length, src, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
        heads = max(q.numel() // max(length * d, 1), 1)  # batch x heads
        self.records.append(OpRecord.gemm(name + ":qk", layer, pass_, dtype, m=length, n=src, k=d, roles={
            "M": (Role.TOKENS, None), "N": (Role.TOKENS, None), "K": (Role.HEAD_DIM, None)}, batch=heads))
        self.records.append(OpRecord.gemm(name + ":pv", layer, pass_, dtype, m=length, n=dv, k=src, roles={
            "M": (Role.TOKENS, None), "N": (Role.HEAD_DIM, None), "K": (Role.TOKENS, None)}, batch=heads))

    def _rnn(self, name, args, layer, pass_) -> None:
        inp = args[0]
        if name == "mkldnn_rnn_layer":  # CPU: one call per layer and direction, time-major input
            pairs, tokens, batch = [(args[1], args[2])], inp.shape[0] * inp.shape[1], args[5].shape[-2]
            hidden = int(args[10])
        elif name == "_cudnn_rnn":
            weights, stride = args[1], args[2]
            pairs = [(weights[i], weights[i + 1]) for i in range(0, len(weights), stride)]
            tokens, batch = inp.shape[0] * inp.shape[1], inp.shape[0 if args[10] else 1]
            hidden = int(args[7])
        else:  # lstm/gru/rnn_* .input overloads, as dispatched on other backends
            params, num_layers, bidirectional = args[2], args[4], args[7]
            # (w_ih, w_hh[, b_ih, b_hh][, w_hr]) per layer and direction, in that order.
            stride = len(params) // (num_layers * (2 if bidirectional else 1))
            pairs = [(params[i], params[i + 1]) for i in range(0, len(params), stride)]
            tokens, batch = inp.shape[0] * inp.shape[1], inp.shape[0 if args[8] else 1]
            hidden = int(pairs[0][0].shape[0]) // _RNN_GATES.get(name, 1)
        dtype = self._eff(pairs[0][0].dtype, "gemm")
        for w_ih, w_hh in pairs:
            # The recurrent GEMM's K is the hidden state's size: hidden_size, or proj_size with projections.
            state, size_in, gated = w_hh.shape[1], w_ih.shape[1], w_ih.shape[0]
            # The input GEMM's K is the input size in the first layer and the hidden size above it:
            # leave it to value matching against the module's rnn_input/rnn_hidden.
            self.records.append(OpRecord.gemm(f"{name}:input", layer, pass_, dtype, m=tokens, n=gated,
                                              k=size_in, roles={"M": (Role.TOKENS, None),
                                                                "N": (Role.RNN_HIDDEN, hidden)}))
            self.records.append(OpRecord.gemm(f"{name}:recurrent", layer, pass_, dtype, m=batch, n=gated,
                                              k=state, roles={
                "M": (Role.TOKENS, None), "N": (Role.RNN_HIDDEN, hidden), "K": (Role.RNN_HIDDEN, state)}))


# ---- running one pass ------------------------------------------------------------------------------


_DTYPE_REQUIRED = (
    "dtype is required: the precision you train in, one of 'float16'/'16-mixed', 'bfloat16'/'bf16-mixed', "
    "'float32'/'32-true', a torch dtype, or 'auto' (the active autocast dtype, else the parameters' dtype). "
    "A torch module does not say which precision it will train in, and float32 without TF32 runs on "
    "CUDA cores, where no Tensor Core rule applies")


def _normalize_dtype(dtype: Any) -> str:
    if dtype is None:
        raise ValueError(_DTYPE_REQUIRED)
    if isinstance(dtype, torch.dtype):
        dtype = _dtype_name(dtype)
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_ALIASES)} or a torch dtype, got {dtype!r}")
    return _DTYPE_ALIASES[key]


def _default_forward(model: torch.nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (list, tuple)):
        return model(*sample)
    return model(sample)


def _default_loss(output: Any) -> torch.Tensor | None:
    parts = [t.float().sum() for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    return torch.stack(parts).sum() if parts else None


def _device_of(model: torch.nn.Module, sample: Any) -> torch.device:
    for t in _tensors(sample):
        return t.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _autocast_on(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except (RuntimeError, TypeError):  # device types without autocast (meta)
        return False


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How the pass runs: under autocast (CUDA), simulated in 16 bits (CPU, meta), or as the model is."""

    autocast: torch.dtype | None
    simulate: str | None
    tf32_matmul: bool
    tf32_conv: bool


def _plan(model: torch.nn.Module, device: torch.device, want: str, tf32: bool | None) -> _Plan:
    params = list(model.parameters())
    param_dtype = params[0].dtype if params else torch.float32
    autocast_dtype, simulate = None, None
    if want == "auto":
        if _autocast_on(device):
            want = _dtype_name(torch.get_autocast_dtype(device.type))
        else:
            want = _dtype_name(param_dtype) if param_dtype in (torch.float16, torch.bfloat16) else "float32"
    if want in ("float16", "bfloat16") and param_dtype == torch.float32:
        if device.type == "cuda" and not _autocast_on(device):
            autocast_dtype = _TORCH_DTYPES[want]
        elif device.type != "cuda":
            simulate = want
    return _Plan(autocast_dtype, simulate,
                 torch.backends.cuda.matmul.allow_tf32 if tf32 is None else bool(tf32),
                 torch.backends.cudnn.allow_tf32 if tf32 is None else bool(tf32))


class _Hooks:
    """Forward hooks on every module: the layer stack the recorder attributes forward ops to, the
    autograd labels backward ops are attributed by, each module's output dtype, and which module
    returned each tensor (to find the model's output layers)."""

    def __init__(self, model: torch.nn.Module, recorder: _Recorder) -> None:
        self.model = model
        self.recorder = recorder
        self.names = {id(m): n for n, m in model.named_modules()}
        self.output_dtypes: dict[str, str] = {}
        self.produced: dict[int, str] = {}  # id of a module output -> the innermost module that returned it
        self.keep_alive: list[torch.Tensor] = []  # ids stay unique while the pass runs

    def _pre(self, module: torch.nn.Module, _args: Any) -> None:
        self.recorder.stack.append((self.names[id(module)], torch._C._autograd._get_sequence_nr()))

    def _post(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        name, start = self.recorder.stack.pop()
        for t in _tensors(output):
            if t.is_floating_point():
                self.output_dtypes[name] = _dtype_name(t.dtype)
                break
        for t in _tensors(output):
            self.produced.setdefault(id(t), name)
            self.keep_alive.append(t)
        _label(output, name, start)

    @contextlib.contextmanager
    def installed(self):
        handles = []
        try:
            for module in self.model.modules():
                handles.append(module.register_forward_pre_hook(self._pre))
                handles.append(module.register_forward_hook(self._post))
            yield self
        finally:
            for h in handles:
                h.remove()

    def output_layers(self, out_ids: set[int]) -> tuple[str, ...]:
        """The modules that returned the model's output tensors; releases the pass's tensors."""
        heads = tuple(sorted({self.produced[i] for i in out_ids if self.produced.get(i)}))
        self.keep_alive.clear()
        return heads


def _run_pass(model: torch.nn.Module, sample: Any, hooks: _Hooks, device: torch.device, plan: _Plan,
              forward: Callable[[torch.nn.Module, Any], Any] | None,
              loss_fn: Callable[[Any], torch.Tensor] | None, backward: bool) -> Any:
    """One forward (and backward) pass under the recorder; returns the model's output. The model is left
    as found: ``.grad`` untouched, buffers restored, the random streams forked."""
    recorder = hooks.recorder
    saved_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    ctx = (torch.autocast(device.type, dtype=plan.autocast) if plan.autocast is not None
           else contextlib.nullcontext())
    cuda_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with hooks.installed(), torch.random.fork_rng(devices=cuda_devices), recorder:
            with ctx:
                output = (forward or _default_forward)(model, sample)
            recorder.phase = "loss" if loss_fn is not None else "quiet"
            loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
            recorder.phase = Pass.BACKWARD
            trainable = [p for p in model.parameters() if p.requires_grad]
            if backward and loss is not None and loss.requires_grad and trainable:
                # autograd.grad, not backward(): nothing lands in .grad, and no gradient-accumulation
                # hook (DDP's reducer, post-accumulate hooks) fires for this one-off pass.
                torch.autograd.grad(loss, trainable, allow_unused=True)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved_buffers:
                    b.copy_(saved_buffers[n])
    return output


def capture(model: torch.nn.Module, sample: Any = None, *, dtype: Any = None, tf32: bool | None = None,
            forward: Callable[[torch.nn.Module, Any], Any] | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, backward: bool = True) -> Capture:
    """Run one forward and backward pass and return what it executed (see :func:`check_alignment`)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if sample is None:
        sample = getattr(model, "example_input_array", None)
        if sample is None:
            raise ValueError("sample is required: pass a batch of model inputs (or set "
                             "model.example_input_array)")
    want = _normalize_dtype(dtype)
    device = _device_of(model, sample)
    plan = _plan(model, device, want, tf32)
    layers, global_dims = _layer_infos(model)
    recorder = _Recorder(plan.simulate, plan.tf32_matmul, plan.tf32_conv)
    hooks = _Hooks(model, recorder)
    output = _run_pass(model, sample, hooks, device, plan, forward, loss_fn, backward)
    out_ids = {id(t) for t in _tensors(output)}
    ops = list(recorder.ops)
    for index, tensor in recorder.softmax_outputs:
        if id(tensor) in out_ids:
            op = ops[index]
            ops[index] = OpPrecision(op.op, op.dtype, op.layer, op.pass_, op.in_loss, is_output=True)
    precision = PrecisionInfo("torch", None, _layer_precisions(model, hooks.output_dtypes), ops)
    return Capture("torch", recorder.records, layers, global_dims, precision,
                   output_layers=hooks.output_layers(out_ids), advice=_ADVICE)


def _label(output: Any, name: str, start: int) -> None:
    """Label the autograd nodes this module's forward created (sequence number >= start) with its name."""
    stack = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        # Nodes point to older nodes only; anything older than the module's start is outside it.
        # Leaves (AccumulateGrad) run no GEMM and belong to no single module.
        if node._sequence_nr() < start or type(node).__name__ == "AccumulateGrad":
            continue
        node.metadata.setdefault(_LABEL, name)
        stack.extend(n for n, _ in node.next_functions if n is not None)


def _layer_precisions(model: torch.nn.Module, outputs: dict[str, str]) -> list[LayerPrecision]:
    result = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        result.append(LayerPrecision(
            name, type(module).__name__, outputs.get(name, _dtype_name(own[0].dtype)),
            tuple(sorted({_dtype_name(p.dtype) for p in own})),
            kind="normalization" if isinstance(module, _NORM_TYPES) else None))
    return result


def check_alignment(model: torch.nn.Module, sample: Any = None, *, dtype: Any = None,
                    target: str | None = None, tf32: bool | None = None,
                    forward: Callable[[torch.nn.Module, Any], Any] | None = None,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    backward: bool = True) -> AlignmentReport:
    """Check a module's executed GEMMs/convolutions against the Tensor Core rules, and audit its precision.

    Args:
        model: any ``torch.nn.Module`` (a LightningModule too).
        sample: one batch of model *inputs* (a tensor, a tuple of positional inputs or a dict of keyword
            inputs); ``None`` uses ``model.example_input_array``.
        dtype: **required**, the math dtype of training: ``"float16"``/``"16-mixed"``,
            ``"bfloat16"``/``"bf16-mixed"``, ``"float32"``/``"32-true"``, a torch dtype, or ``"auto"`` (the
            active autocast dtype, else the parameters' dtype). A report that is clean only because
            no rule applied (float32 without TF32) comes with a ``NoRuleAppliedWarning``.
        target: ``None`` or a GPU name (``"a100"``, ``"h100"``, ``"v100"``...) for its recommendations.
        tf32: whether float32 matmuls/convolutions run as TF32; ``None`` reads
            ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32``.
        forward: ``forward(model, sample) -> output``; defaults to calling the model on the sample.
        loss_fn: ``loss_fn(output) -> scalar``; defaults to the sum of the floating outputs.
        backward: also run the backward pass (its GEMMs add the weight-gradient view of the token
            dimension; the findings on model dimensions are the same from the forward pass alone).

    Returns:
        An :class:`~lossscale_callbacks.alignment.AlignmentReport`.

    Example:
        >>> import torch
        >>> report = check_alignment(torch.nn.Linear(64, 128), torch.zeros(32, 64), dtype="float16")
        >>> report.findings, report.has("high")
        ([], False)
    """
    get_target(target)  # validate before running anything
    cap = capture(model, sample, dtype=dtype, tf32=tf32, forward=forward, loss_fn=loss_fn, backward=backward)
    want = _normalize_dtype(dtype)
    report = analyze(cap, target=target)
    given = sample if sample is not None else getattr(model, "example_input_array", None)
    first = next(_tensors(given), None)
    report.context = {
        "model": type(model).__name__, "framework": "torch",
        "parameters": sum(p.numel() for p in model.parameters()), "precision": want,
        "batch_size": int(first.shape[0]) if first is not None and first.dim() else None,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if tf32 is None else bool(tf32)}
    return warn_if_nothing_checked(report, "pass dtype='float16' (or 'bfloat16') for mixed precision")
