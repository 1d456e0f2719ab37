"""`--optim adamw_bf16_sr`: AdamW for bf16 weights that keeps small updates, at the memory traffic of plain bf16
AdamW.

Plain bf16 AdamW rounds each new weight to the nearest bf16 value, so an update below half of bf16's spacing (2**-9
of the weight) is lost, every step: late in a fine-tune, at a small learning rate, most updates are that small.
Here the update is computed in fp32 and written back with stochastic rounding (up with probability equal to the
fraction of the spacing), which is exact in expectation: the tiny updates accumulate as they would in fp32. The
Adam states are bf16 by default and rounded stochastically too: with round-to-nearest a bf16 second moment cannot
follow a shrinking gradient (beta2 = 0.999 moves it by 0.1% per step, under half its spacing), so it would stay
high and shrink the step. `--optim_args state_dtype=float32` keeps fp32 states instead (4 more bytes per
parameter).

Bytes moved per parameter and step, as plain bf16 fused AdamW: read weight, gradient, two states (2 B each), write
weight and states (bf16 states: 14 B; fp32 states: 22 B). The random bits come from a counter-based hash of
(seed, step, parameter, element), computed in registers: no random tensor is stored, and the result is the same
on every rank (DDP replicas stay identical), on a shard as on the whole tensor (FSDP2: the hash takes the global
element index), eagerly as compiled, and after a resume (nothing but the step count is needed to draw them again).
On CUDA the update of each parameter is one kernel (torch.compile, dynamic shapes: one graph for all parameters),
16 parameters of the same dtypes launched by one compiled call (the host's cost is per call); elsewhere it runs
eagerly, one parameter at a time (`--optim_args compile=true` compiles there too).

Nothing in a step is read on the host: the step counts live beside the parameters, and the bias corrections and
the random bits' keys are computed from them there, so that a step the NaN guard (sft/safety/guards.py) marks bad
through GradScaler's `found_inf` changes no weight, state or step count without the host waiting for the verdict.

Gradient clipping is folded into that kernel (`clip_gradients`, called by SFTTrainer._clip_grad_norm): torch's `clip_grad_norm_` reads every gradient for
the norm, then reads and writes every gradient again to scale it (28 GB of memory traffic a step for a 7B model's
bf16 gradients, ~7 ms on an H200); here the norm is computed as before and its coefficient is multiplied into each
gradient as the update reads it.
"""

from __future__ import annotations

import math

import torch
import torch.fx.experimental._config

from sft.safety.private_names import DUCK_SHAPE, expect


MASK32 = 0xFFFFFFFF
HASH_MULTIPLIER = 0x45D9F3B


def wrap32(x):
    """x modulo 2**32: Python ints need it; int32 tensors wrap by themselves (two's complement), which gives the
    same 32 bits."""
    return x & MASK32 if isinstance(x, int) else x


def hash32(x):
    """A 32-bit integer hash (two multiply-xorshift rounds; every input bit reaches every output bit), on Python
    ints in [0, 2**32) and on int32 tensors holding the same bits: the same bits on every backend, eager or
    compiled. int32, not int64: on a GPU a 64-bit multiply is several 32-bit ones, and the update below hashes
    every element twice. The `& 0xFFFF` makes the shift logical (int32's is arithmetic)."""
    x = wrap32((((x >> 16) & 0xFFFF) ^ x) * HASH_MULTIPLIER)
    x = wrap32((((x >> 16) & 0xFFFF) ^ x) * HASH_MULTIPLIER)
    return ((x >> 16) & 0xFFFF) ^ x


GOLDEN = 0x9E3779B9


def key_of(*numbers: int) -> int:
    """A 32-bit key from small integers (seed, step, parameter index, which tensor), mixed on the host."""
    key = 0
    for n in numbers:
        key = hash32((key ^ (n & MASK32)) + GOLDEN & MASK32)
    return key


def as_int32(n: int) -> int:
    """An unsigned 32-bit value as the int32 with the same bits (what an int32 tensor can hold)."""
    return n - (1 << 32) if n >= 1 << 31 else n


def step_keys(seed: int, steps: torch.Tensor, indexes: torch.Tensor) -> torch.Tensor:
    """key_of(seed, step, index, which) for which in (0, 1), as int32 bits, for int32 vectors of steps and
    parameter indexes (non-negative): the step counts live on the device (so that a skipped step leaves them
    unchanged without a host read), and so are their keys. -> int32 [n, 2], the host's bits (as_int32)."""
    def mix(key: torch.Tensor, n) -> torch.Tensor:  # one round of key_of, wrapping in int32 as it masks on ints
        return hash32((key ^ n) + as_int32(GOLDEN))

    key = mix(mix(steps, as_int32(key_of(seed))), indexes)  # (mix is symmetric: the seed's key ^ the step)
    return torch.stack([mix(key, which) for which in (0, 1)], dim=1)


def round_to_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, stochastically: add 16 random bits below bf16's last bit, then cut them off. The result is
    the bf16 neighbour above |x| with probability (the cut-off fraction) / 2**16, else the one below: exact in
    expectation. `random16`: int32 in [0, 2**16), one per element."""
    bits = (x.view(torch.int32) + random16) & -65536  # the sign is in bit 31: this rounds the magnitude
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def write(target: torch.Tensor, value: torch.Tensor, random16: torch.Tensor, skip: torch.Tensor) -> None:
    """Store fp32 `value` into `target`: stochastically rounded into bf16, else as the target's dtype; where `skip`
    (a 0-d bool) is set, the target keeps its values (a NaN/inf step: GradScaler's found_inf)."""
    new = round_to_bf16(value, random16) if target.dtype == torch.bfloat16 else value
    target.copy_(torch.where(skip, target, new))


def adamw_update(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 hyper: torch.Tensor, keys: torch.Tensor, found_inf: torch.Tensor) -> None:
    """One AdamW step of one flat tensor, in place, in fp32 (torch.optim.AdamW's arithmetic: its fp32 result within
    an fp32 rounding or two, tests/test_sr_adamw.py), then each result stored as its tensor's dtype.
    `hyper`: fp32 [1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / bias_correction1,
    sqrt(bias_correction2), eps, the clipping's coefficient], computed in double on the host as torch.optim.AdamW
    does (the coefficient on the device, from the norm: `clip_gradients`; the bias corrections on the device, from
    the step count: `AdamWBf16SR.step`);
    `keys`: int32 [this step's two keys (as_int32), the global index of element 0 (FSDP2 shards), the parameter's
    index]; `found_inf`: a 0-d float, 1 where the step is to change nothing."""
    decay, one_minus_beta1, beta2, one_minus_beta2, step_size, correction2_sqrt, eps, clip = hyper[:8].unbind()
    index = torch.arange(p.numel(), device=p.device, dtype=torch.int32) + keys[2]
    h1 = hash32(index ^ keys[0])
    h2 = hash32(index ^ keys[1])
    param = p.float() * decay
    g = grad.float() * clip  # as clip_grad_norm_ would have left it (exactly so for fp32 gradients)
    m = exp_avg.float().lerp(g, one_minus_beta1)
    v = exp_avg_sq.float() * beta2 + one_minus_beta2 * g * g
    param = param - step_size * m / (v.sqrt() / correction2_sqrt + eps)
    skip = found_inf != 0
    write(p, param, h1 & 0xFFFF, skip)
    write(exp_avg, m, (h1 >> 16) & 0xFFFF, skip)
    write(exp_avg_sq, v, h2 & 0xFFFF, skip)


GROUP_SIZE = 16  # parameters per compiled call (AdamWBf16SR.group_size)


def adamw_update_group(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                       exp_avg_sqs: list[torch.Tensor], hyper: torch.Tensor, keys: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
    """adamw_update of each of a group's parameters, row i of `hyper` and `keys` being the i-th one's: compiled, one
    call (one graph's guards, one wrapper) launches the group's kernels, where one call per parameter paid the
    compiled function's host cost per parameter (bench/optimizer_host_cost.py)."""
    for i in range(len(params)):
        adamw_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], hyper[i], keys[i], found_inf)


_compiled: dict = {}


def compiled(function):
    """`function` compiled once, dynamic in the lengths (one graph for every parameter, or every group of a size
    and dtypes; inductor fuses each parameter's elementwise update into one kernel)."""
    if function not in _compiled:
        _compiled[function] = torch.compile(function, dynamic=True, fullgraph=True)
    return _compiled[function]


def local_and_offset(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A DTensor's local shard (FSDP2) and the global flat index of its first element; a plain tensor and 0."""
    if not hasattr(t, "to_local"):
        return t, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local()
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if local.numel() and any(offsets[1:]):  # FSDP2 shards dim 0 only: a shard is a contiguous global range
        raise NotImplementedError(f"adamw_bf16_sr: a shard at offset {tuple(offsets)}; only dim-0 sharding is "
                                  f"supported")
    return local, offsets[0] * math.prod(t.shape[1:])


def flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("adamw_bf16_sr updates contiguous tensors in place; got a non-contiguous one")
    return t.view(-1)


class DeviceWork:
    """One device's share of a step: its parameters' flat tensors, and what their scalars are made of."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # every step count to advance (empty FSDP2 shards' too)
        self.params: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []  # (param, grad, states)
        self.dtypes: list[tuple[torch.dtype, ...]] = []  # theirs, in that order (what a compiled group shares)
        self.param_steps: list[torch.Tensor] = []
        self.hyper: list[list[float]] = [[0.0] * 8]  # an unused row 0: see scalars
        self.keys: list[list[int]] = [[0] * 4]
        self.schedule: list[list[float]] = []  # lr, beta1, beta2 of each parameter's group

    def add(self, param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], step: torch.Tensor,
            hyper: list[float], keys: list[int], schedule: list[float]) -> None:
        self.params.append((param, grad, states))
        self.dtypes.append((param.dtype, grad.dtype, *(s.dtype for s in states)))
        self.param_steps.append(step)
        self.hyper.append(hyper)
        self.keys.append(keys)
        self.schedule.append(schedule)

    def scalars(self, device: torch.device, seed: int, coefficient: torch.Tensor | None):
        """-> (hyper, keys) for adamw_update, one row per parameter after row 0: one host->device copy of each per
        device and step, then the bias corrections and the random bits' keys from the step counts, on the device.
        Rows of 32 and 16 bytes (16-byte aligned views: inductor would copy misaligned ones) after an unused row 0
        (a view at storage offset 0 would get a graph of its own: dynamo specializes 0).

        The bias corrections are computed in double from the step counts as the host did in Python (lr / (1 -
        beta1 ** step), sqrt(1 - beta2 ** step)), then rounded to fp32: torch's double pow can differ from
        Python's by an ulp, which the rounding to fp32 removed for every step up to 200,000 at the usual betas and
        rates (CPU; tests/test_sr_adamw.py holds the update to the host-computed one bit for bit)."""
        self._order_by_dtypes()
        hyper = torch.tensor(self.hyper, dtype=torch.float32).to(device, non_blocking=True)
        keys = torch.tensor(self.keys, dtype=torch.int32).to(device, non_blocking=True)
        lr, beta1, beta2 = torch.tensor(self.schedule, dtype=torch.float64).to(device, non_blocking=True).unbind(1)
        step = torch.stack(self.param_steps).double()
        hyper[1:, 4] = lr / (1 - beta1 ** step)
        hyper[1:, 5] = (1 - beta2 ** step).sqrt()
        keys[1:, :2] = step_keys(seed, step.int(), keys[1:, 3])
        if coefficient is not None:  # on the device: no wait for the norm
            hyper[1:, 7] = coefficient
        return hyper, keys

    def _order_by_dtypes(self) -> None:
        """Parameters of the same dtypes next to each other (in their order otherwise), so that a compiled group
        takes consecutive rows: the rows' order changes nothing else (each row names its parameter's index)."""
        if len(set(self.dtypes)) == 1:
            return
        order = sorted(range(len(self.params)), key=lambda i: [str(d) for d in self.dtypes[i]])
        self.params = [self.params[i] for i in order]
        self.dtypes = [self.dtypes[i] for i in order]
        self.param_steps = [self.param_steps[i] for i in order]
        self.hyper = self.hyper[:1] + [self.hyper[i + 1] for i in order]
        self.keys = self.keys[:1] + [self.keys[i + 1] for i in order]
        self.schedule = [self.schedule[i] for i in order]

    def runs_of_same_dtypes(self) -> list[tuple[int, int]]:
        """[start, end) of each run of parameters with the same dtypes (after scalars() ordered them)."""
        runs, start = [], 0
        for i in range(1, len(self.dtypes) + 1):
            if i == len(self.dtypes) or self.dtypes[i] != self.dtypes[start]:
                runs.append((start, i))
                start = i
        return runs


class AdamWBf16SR(torch.optim.Optimizer):
    """AdamW whose bf16 weights (and bf16 states) are written back with stochastic rounding; see the module
    docstring. fp32 weights get a plain fp32 AdamW (nothing to round).

    GradScaler's protocol, as torch's fused AdamW takes it: `found_inf` (a 0-d tensor set on the optimizer before
    `step`) of 1 leaves every weight, state and step count as it was, decided on the device (no host read: the NaN
    guard, sft/safety/guards.py, hands its verdict over so); `grad_scale`, where set, divides the gradients."""

    _step_supports_amp_scaling = True
    skips_on_found_inf = True  # what the NaN guard asks before handing its verdict over (sft/safety/guards.py)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, state_dtype: str | torch.dtype = torch.bfloat16, seed: int = 0,
                 compile: bool | None = None):
        state_dtype = getattr(torch, state_dtype) if isinstance(state_dtype, str) else state_dtype
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"adamw_bf16_sr: state_dtype {state_dtype}: use bfloat16 or float32")
        if not 0.0 <= lr or not 0.0 <= eps or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"adamw_bf16_sr: invalid lr {lr}, eps {eps} or betas {betas}")
        expect(DUCK_SHAPE)  # the private torch setting each step relies on (below): checked once, here
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype, self.seed, self.compile = state_dtype, seed, compile
        self.group_size = GROUP_SIZE
        self.clip_coefficient: torch.Tensor | None = None  # set by clip_gradients, used by the next step

    def clip_gradients(self, parameters, max_norm: float) -> torch.Tensor | None:
        """torch.nn.utils.clip_grad_norm_ (L2) with its scaling deferred into the next step's update: -> the total
        norm of the gradients before clipping, as clip_grad_norm_ returns it. None (nothing done) for sharded
        gradients (DTensor: FSDP2, TP), whose norm needs their mesh: clip those the usual way."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads or any(hasattr(g, "to_local") for g in grads):
            return None
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if math.isfinite(max_norm):  # (the Trainer asks with inf for the norm alone)
            self.clip_coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s
        return norm

    def _compiles_on(self, device: torch.device) -> bool:
        return self.compile if self.compile is not None else device.type == "cuda"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        work: dict[torch.device, DeviceWork] = {}
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])  # a tensor lr (DCP's state initialisation) works too
            for p in group["params"]:
                index += 1  # the parameter's place in the optimizer: the same on every rank and after a resume
                if p.grad is None:
                    continue
                local, offset = local_and_offset(p.detach())
                state = self.state[p]
                if not state:  # its first step (a resume loads the states): its size is checked once
                    if p.numel() >= 1 << 31:  # the element index is int32 (hash32)
                        raise ValueError(f"adamw_bf16_sr: a parameter of {p.numel()} values; at most 2**31 - 1")
                    state["step"] = torch.zeros((), device=local.device)  # fp32, beside its parameter (torch's fused)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
                if state["step"].device != local.device:  # (new, or saved by a version that kept it on the host)
                    state["step"] = state["step"].to(local.device, torch.float32)
                on_device = work.setdefault(local.device, DeviceWork())
                on_device.steps.append(state["step"])
                if local.numel() == 0:
                    continue
                states = [flat(local_and_offset(state[key])[0]) for key in ("exp_avg", "exp_avg_sq")]
                on_device.add(flat(local), local_and_offset(p.grad)[0].reshape(-1), states, state["step"],
                              [1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, 0.0, 0.0, group["eps"], 1.0],
                              [0, 0, offset, index], [lr, beta1, beta2])
        for device, on_device in work.items():
            skip = torch.zeros((), device=device) if found_inf is None else found_inf.to(device, torch.float32)
            # The step counts on the device: a skipped step (found_inf 1) leaves them as they were, with no host read.
            # (A list, as torch's fused Adam passes found_inf: a lone tensor operand is read on the host on a CPU.)
            torch._foreach_add_(on_device.steps, [1 - skip] * len(on_device.steps))
            if on_device.params:
                hyper, keys = on_device.scalars(device, self.seed, self._coefficient(device, grad_scale))
                self._update(device, on_device, hyper, keys, skip)
        self.clip_coefficient = None
        return loss

    def _coefficient(self, device: torch.device, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """What multiplies every gradient in the update: the clipping's coefficient, over GradScaler's scale where
        it hands the gradients over still scaled (fp16); None for 1."""
        coefficient = None if self.clip_coefficient is None else self.clip_coefficient.to(device)
        if grad_scale is not None:
            coefficient = (1.0 if coefficient is None else coefficient) / grad_scale.to(device, torch.float32)
        return coefficient

    def _update(self, device: torch.device, on_device: DeviceWork, hyper: torch.Tensor, keys: torch.Tensor,
                skip: torch.Tensor) -> None:
        """Eagerly one parameter at a time; compiled, `group_size` parameters of the same dtypes per call (rows in
        that order: DeviceWork.scalars) and the rest one at a time (one graph per group size, not per remainder)."""
        compiles = self._compiles_on(device)
        single = compiled(adamw_update) if compiles else adamw_update
        # Without duck sizing, a view's offset or a parameter's length that happens to equal another's is not taken
        # for a relation between them (which the next call breaks: a recompile). Read when a graph compiles.
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            for start, end in on_device.runs_of_same_dtypes() if compiles else [(0, len(on_device.params))]:
                row = start + 1  # (row 0 unused)
                while compiles and end - (row - 1) >= self.group_size > 1:
                    group = on_device.params[row - 1:row - 1 + self.group_size]
                    compiled(adamw_update_group)([g[0] for g in group], [g[1] for g in group],
                                                 [g[2][0] for g in group], [g[2][1] for g in group],
                                                 hyper[row:row + self.group_size], keys[row:row + self.group_size],
                                                 skip)
                    row += self.group_size
                for i in range(row, end + 1):
                    param, grad, (exp_avg, exp_avg_sq) = on_device.params[i - 1]
                    single(param, grad, exp_avg, exp_avg_sq, hyper[i], keys[i], skip)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict casts every floating-point state to its parameter's dtype: fp32 states of bf16
        weights would come back bf16 (rounded). Put the saved tensors back in their own dtype."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved and saved[key].dtype != self.state[p][key].dtype:
                    self.state[p][key] = saved[key].to(device=p.device, copy=True)


def optim_arg_pairs(text: str | None) -> list[list[str]]:
    """`--optim_args "a=1, b=2"` as transformers writes it -> [["a", "1"], ["b", "2"]] (a malformed item stays a
    one-element list, for the caller's error)."""
    return [kv.split("=", 1) for kv in (text or "").replace(" ", "").split(",") if kv]


def optimizer_kwargs(optim_args: dict[str, str], seed: int) -> dict:
    """Our keyword arguments from `--optim_args` (transformers hands them over as strings); a ConfigError for
    what we do not take (sft/options/arguments.py calls this while parsing, before any model loads)."""
    from sft.errors import ConfigError

    known = {"state_dtype", "seed", "compile"}
    unknown = set(optim_args) - known
    if unknown:
        raise ConfigError(f"unknown --optim_args {', '.join(sorted(unknown))} (known: "
                          f"{', '.join(sorted(known))})")
    if optim_args.get("state_dtype", "bfloat16") not in ("bfloat16", "float32"):
        raise ConfigError(f"--optim_args state_dtype={optim_args['state_dtype']}: use bfloat16 "
                          f"(the default) or float32")
    if not str(optim_args.get("seed", seed)).isdigit():
        raise ConfigError(f"--optim_args seed={optim_args['seed']}: give a whole number")
    kwargs: dict = {"seed": int(optim_args.get("seed", seed)), "state_dtype": optim_args.get("state_dtype", "bfloat16")}
    if "compile" in optim_args:
        value = optim_args["compile"].lower()
        if value not in ("1", "true", "yes", "0", "false", "no"):
            raise ConfigError(f"--optim_args compile={optim_args['compile']}: give true or false")
        kwargs["compile"] = value in ("1", "true", "yes")
    return kwargs
