"""sft/speed/sr_adamw.py: `--optim adamw_bf16_sr`, AdamW for bf16 weights with stochastic rounding (weights and states),
against torch's fp32 AdamW, through the HF Trainer (resume) and under FSDP2 (two gloo ranks)."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from sft.speed.sr_adamw import AdamWBf16SR, adamw_update, as_int32, hash32, key_of, round_to_bf16, step_keys


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: on a loaded 2-core machine torch's thread pool made one sqrt of 4096 values take 10 ms
    (5 us on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above |x| (the same value twice where x is one), with x's sign."""
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)
    up = torch.where(bits & 0xFFFF != 0, ((bits & -65536) + 0x10000).view(torch.float32), down)
    return down, up


def test_hash_on_int32_tensors_gives_the_bits_of_the_python_hash():
    """The update hashes int32 tensors (wrapping multiplies, arithmetic shifts masked); the host hashes Python
    ints. Both must give the same 32 bits, also for inputs with the top bit set."""
    values = [0, 1, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1] + [key_of(3, n) for n in range(200)]
    got = hash32(torch.tensor([as_int32(v) for v in values], dtype=torch.int32))
    assert got.dtype == torch.int32
    assert got.tolist() == [as_int32(hash32(v)) for v in values]


def test_keys_made_on_the_device_are_the_hosts():
    """The step counts live on the device, so the random bits' keys are made there: the same bits as key_of."""
    steps, indexes = [1, 2, 7, 1000, 2**31 - 1], [0, 5, 272, 2**20, 3]
    got = step_keys(11, torch.tensor(steps, dtype=torch.int32), torch.tensor(indexes, dtype=torch.int32))
    assert got.tolist() == [[as_int32(key_of(11, s, i, which)) for which in (0, 1)] for s, i in zip(steps, indexes)]


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    """Each rounding is one of the two bf16 neighbours; averaged over 4000 draws of the hash it is the fp32 value
    (within 5 standard errors of the rounding's own variance, per value)."""
    x = torch.randn(500, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 3, 500)
    down, up = bf16_neighbours(x)
    draws = 4000
    index = torch.arange(x.numel(), dtype=torch.int32)
    total = torch.zeros_like(x, dtype=torch.float64)
    for draw in range(draws):
        random16 = hash32(index ^ as_int32(key_of(7, draw))) & 0xFFFF
        rounded = round_to_bf16(x, random16).float()
        assert bool(((rounded == down) | (rounded == up)).all())
        total += rounded.double()
    mean = total / draws
    p = ((x.double() - down.double()) / (up.double() - down.double())).nan_to_num(0.0)
    standard_error = (up.double() - down.double()).abs() * (p * (1 - p) / draws).sqrt()
    assert bool(((mean - x.double()).abs() <= 5 * standard_error + 1e-12 * x.double().abs()).all())
    # and it is not a rounding to nearest: values near the middle land on both sides
    assert 0.3 < ((mean - down.double()) / (up.double() - down.double())).nan_to_num(0.5).mean().item() < 0.7


def drift_after(optimizer_class, steps: int = 200, lr: float = 1e-4, **kwargs) -> float:
    """Weights of 1.0 (bf16), a constant gradient: Adam's step is then lr exactly, far below half of bf16's
    spacing below 1.0 (2**-9). -> how far the mean weight moved, over what fp32 AdamW moves it (1.0 = all)."""
    p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    optimizer = optimizer_class([p], lr=lr, weight_decay=0.0, **kwargs)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        optimizer.step()
    return (1.0 - p.float().mean().item()) / (steps * lr)


def test_tiny_updates_accumulate_where_plain_bf16_adamw_drops_them():
    assert drift_after(torch.optim.AdamW) == 0.0  # plain bf16 AdamW: every update lost (what TRL's bf16 run does)
    assert abs(drift_after(AdamWBf16SR) - 1.0) < 0.03  # the rounding noise of the mean: ~0.7% (one sigma)
    assert abs(drift_after(AdamWBf16SR, state_dtype="float32") - 1.0) < 0.03


def test_bf16_second_moment_follows_a_shrinking_gradient():
    """With round-to-nearest a bf16 exp_avg_sq cannot decay by beta2 = 0.999 per step (0.1% is under half its
    spacing): stochastic rounding lets it decay as fp32 does."""
    p = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
    optimizer = AdamWBf16SR([p], lr=0.0)
    p.grad = torch.ones_like(p)
    optimizer.step()
    for _ in range(500):
        p.grad = torch.zeros_like(p)
        optimizer.step()
    want = 0.001 * 0.999 ** 500
    got = optimizer.state[p]["exp_avg_sq"].float().mean().item()
    assert abs(got / want - 1) < 0.01, (got, want)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_fp32_adamw_up_to_rounding(weight_decay):
    """fp32 weights and states: torch.optim.AdamW's result within an fp32 rounding or two. bf16 weights: after a
    step from the same values and gradients, every weight is one of the two bf16 neighbours of torch's fp32
    result (the fp32 result itself may sit a rounding away from a neighbour: then either side counts)."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, 96, generator=generator).bfloat16().float()  # bf16 values: the same start for all
    grads = [torch.randn(64, 96, generator=generator).bfloat16().float() for _ in range(5)]

    def run(optimizer_class, dtype, steps, **kwargs):
        p = torch.nn.Parameter(start.to(dtype).clone())
        optimizer = optimizer_class([p], lr=1e-2, weight_decay=weight_decay, **kwargs)
        for grad in grads[:steps]:
            p.grad = grad.to(dtype)
            optimizer.step()
        return p.detach().float()

    ours = run(AdamWBf16SR, torch.float32, 5, state_dtype="float32")
    reference = run(torch.optim.AdamW, torch.float32, 5, foreach=False)
    assert torch.allclose(ours, reference, rtol=1e-6, atol=1e-8), (ours - reference).abs().max()

    ours, reference = run(AdamWBf16SR, torch.bfloat16, 1), run(torch.optim.AdamW, torch.float32, 1, foreach=False)
    slack = reference.abs() * 2**-22  # two fp32 roundings
    low, _ = bf16_neighbours(reference - slack.copysign(reference))
    _, high = bf16_neighbours(reference + slack.copysign(reference))
    assert bool(((ours.abs() >= low.abs()) & (ours.abs() <= high.abs())).all())
    assert (ours != reference.bfloat16().float()).any()  # not rounding to nearest


def host_computed_step(params, states, steps, groups, seed, clip=None):
    """The update as adamw_bf16_sr computed it before its step counts moved to the device: bias corrections in
    double on the host, keys by key_of, one adamw_update per parameter. `states`: [exp_avg, exp_avg_sq] per
    parameter (updated in place); `steps`: the host's step counts (advanced here); `groups`: (lr, betas,
    weight_decay, eps) per parameter."""
    for index, (p, (exp_avg, exp_avg_sq), (lr, (beta1, beta2), weight_decay, eps)) in \
            enumerate(zip(params, states, groups)):
        steps[index] += 1
        step = steps[index]
        hyper = torch.tensor([1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step),
                              math.sqrt(1 - beta2 ** step), eps, 1.0], dtype=torch.float32)
        if clip is not None:
            hyper[7] = clip
        keys = torch.tensor([*(as_int32(key_of(seed, step, index, which)) for which in (0, 1)), 0, index],
                            dtype=torch.int32)
        adamw_update(p.detach().view(-1), p.grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1), hyper, keys,
                     torch.zeros(()))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_found_inf_skips_the_step_on_the_device_and_zero_steps_as_the_host_computed_update(state_dtype):
    """GradScaler's protocol (the NaN guard's verdict): with found_inf = 1 the step changes no weight, no state and
    no step count, even with NaN gradients; with found_inf = 0, or none, the update equals the one whose bias
    corrections and keys the host computed (before the step counts moved to the device) bit for bit: two groups
    (their own rate, betas and weight decay), bf16 and fp32 weights, a clipping coefficient, a rate changing
    every step, a skipped step in between (the host's count does not advance there either)."""
    shapes, dtypes = [(64, 48), (33,), (16, 16)], [torch.bfloat16, torch.bfloat16, torch.float32]
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=generator).to(d) for s, d in zip(shapes, dtypes)]
    grads = [[torch.randn(s, generator=generator).to(d) for s, d in zip(shapes, dtypes)] for _ in range(6)]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = AdamWBf16SR([{"params": params[:2]},
                             {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, seed=5)
    reference = [t.clone() for t in start]
    for r, g in zip(reference, grads[0]):
        r.grad = g
    reference_states = [[torch.zeros_like(t, dtype=getattr(torch, state_dtype)) for _ in range(2)] for t in start]
    host_steps = [0, 0, 0]
    for number, step_grads in enumerate(grads):
        skipped = number == 3
        rates = (1e-2 / (number + 1), 3e-3 / (number + 1))
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for p, r, g in zip(params, reference, step_grads):
            p.grad = torch.full_like(g, math.nan) if skipped else g.clone()
            r.grad = g.clone()
        before = [p.detach().clone() for p in params]
        states_before = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
        clip = torch.tensor(0.5) if number == 2 else None
        optimizer.clip_coefficient = clip
        if skipped or number % 2:  # found_inf handed over (0 or 1); else none at all
            optimizer.found_inf = torch.tensor(1.0 if skipped else 0.0)
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
        if skipped:
            assert all(torch.equal(a, b) for a, b in zip(before, params))
            assert all(torch.equal(states_before[i][k], optimizer.state[p][k]) for i, p in enumerate(params)
                       for k in ("step", "exp_avg", "exp_avg_sq"))
            continue
        groups = [(rates[0], (0.9, 0.999), 0.1, 1e-8)] * 2 + [(rates[1], (0.8, 0.99), 0.0, 1e-8)]
        host_computed_step(reference, reference_states, host_steps, groups, seed=5, clip=clip)
        assert all(torch.equal(p.detach(), r) for p, r in zip(params, reference)), number
        assert all(torch.equal(optimizer.state[p]["exp_avg_sq"], s[1]) for p, s in zip(params, reference_states))
    assert [float(optimizer.state[p]["step"]) for p in params] == host_steps == [5, 5, 5]


def test_a_scaled_gradient_is_divided_by_grad_scale():
    """GradScaler hands fp16's still-scaled gradients over with `grad_scale`: the update divides them (a power of
    two: exactly the update of the unscaled gradients)."""
    def run(scale):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 300))
        optimizer = AdamWBf16SR([p], lr=1e-2)
        for step in range(2):
            p.grad = torch.randn(300, generator=torch.Generator().manual_seed(step)) * scale
            if scale != 1:
                optimizer.grad_scale = torch.tensor(float(scale))
            optimizer.step()
        return p.detach()

    assert torch.equal(run(1), run(1024)) and not torch.equal(run(1), torch.linspace(-1, 1, 300))


def test_same_draws_on_every_replica_and_a_different_draw_each_step():
    """DDP replicas must stay identical: the rounding depends on (seed, step, parameter, element), not on the
    process. And each step draws anew (or the same element would round the same way every step: biased)."""
    def run(steps, seed=0):
        p = torch.nn.Parameter(torch.full((2048,), 1.0, dtype=torch.bfloat16))
        optimizer = AdamWBf16SR([p], lr=1e-3, seed=seed)
        history = []
        for _ in range(steps):
            p.grad = torch.ones_like(p)
            optimizer.step()
            history.append(p.detach().clone())
        return history

    a, b = run(2), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(run(1, seed=1)[0], a[0])
    # A step of 1e-3 below 1.0 (spacing 2**-8) rounds down with probability 0.256 at each step. Reusing step 1's
    # bits at step 2 would move none of the weights that step 1 left at 1.0 (the same bits, the same fraction).
    stayed = a[0] == 1.0
    assert 0.2 < (a[0] != 1.0).float().mean().item() < 0.32
    assert 0.2 < (a[1][stayed] != 1.0).float().mean().item() < 0.32


@pytest.mark.slow
def test_compiled_update_equals_eager_bit_for_bit():
    """The GPU path (torch.compile, one graph for all lengths; parameters of the same dtypes updated in groups,
    here of 2: two groups and one alone among the bf16 weights, an fp32 one alone in between) against the eager one:
    the same hash, the same arithmetic, the same skip of a found_inf step, so the same bits. Default (bf16) states;
    40-60 s on 2 cores (inductor's C++ compiles)."""
    shapes = [(64, 48), (256,), (24,), (33, 16), (40,), (8, 8)]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]

    def run(compile):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(d)) for s, d in zip(shapes, dtypes)]
        optimizer = AdamWBf16SR(params, lr=1e-2, weight_decay=0.1, compile=compile)
        optimizer.group_size = 2
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            optimizer.found_inf = torch.tensor(float(step == 1))  # the middle step skipped, on the device
            optimizer.step()
        return params + [optimizer.state[p][k] for p in params for k in ("exp_avg_sq", "step")]

    from sft.speed import sr_adamw

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))
    assert sr_adamw.adamw_update_group in sr_adamw._compiled  # the groups went through their compiled call


def test_optim_name_parses_and_the_trainer_builds_it(tmp_path):
    from sft.options.arguments import SFTTrainingArguments, parse_args
    from sft.errors import ConfigError
    from sft.speed.lowbit import rounds_stochastically
    from sft.trainer import SFTTrainer

    parsed = parse_args(["--optim", "adamw_bf16_sr", "--output_dir", str(tmp_path)])[3]  # the command line's path
    assert parsed.optim == "adamw_bf16_sr"
    args = SFTTrainingArguments(output_dir=str(tmp_path), optim="adamw_bf16_sr", use_cpu=True, report_to="none",
                                optim_args="state_dtype=float32", weight_decay=0.01, seed=3)
    assert args.optim == "adamw_bf16_sr"
    optimizer_class, kwargs = SFTTrainer.get_optimizer_cls_and_kwargs(args)
    assert optimizer_class is AdamWBf16SR and kwargs["state_dtype"] == "float32" and kwargs["seed"] == 3
    assert rounds_stochastically("adamw_bf16_sr", None)
    assert not rounds_stochastically("adamw_torch_fused", None)
    assert rounds_stochastically("adamw_torch_8bit", "bf16_stochastic_round=True")
    for optim_args, message in (("state_dtype=float16", "state_dtype=float16: use bfloat16"),
                                ("block_size=128", "unknown --optim_args block_size"), ("seed", "key=value"),
                                ("compile=maybe", "compile=maybe: give true or false")):
        with pytest.raises(ConfigError, match=message):  # while parsing, before any model loads
            parse_args(["--optim", "adamw_bf16_sr", "--optim_args", optim_args])
    args.optim_args = "block_size=128"
    with pytest.raises(ConfigError, match="unknown --optim_args block_size"):  # and if parsing was bypassed
        SFTTrainer.get_optimizer_cls_and_kwargs(args)


def test_resumed_trainer_run_equals_the_uninterrupted_one(tmp_path):
    """HF Trainer, bf16 tiny Llama, fp32 states (torch's load_state_dict would cast them to bf16: without
    AdamWBf16SR.load_state_dict this test fails): 4 steps in one go (saving at step 2) against a second run resumed
    from that step-2 checkpoint. Weights and states equal bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft.options.arguments import SFTTrainingArguments
    from sft.trainer import SFTTrainer

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 16),
                                                                        generator=torch.Generator().manual_seed(0))]

    def train(output_dir, max_steps, resume=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        args = SFTTrainingArguments(output_dir=str(output_dir), optim="adamw_bf16_sr", optim_args="state_dtype=float32",
                                    use_cpu=True, report_to="none", max_steps=max_steps, save_steps=2,
                                    per_device_train_batch_size=4, learning_rate=1e-3, weight_decay=0.1,
                                    lr_scheduler_type="linear", logging_steps=100, seed=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer.optimizer

    whole, whole_optimizer = train(tmp_path / "whole", 4)
    resumed, resumed_optimizer = train(tmp_path / "resumed", 4, resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    for a, b in zip(whole.parameters(), resumed.parameters()):
        state_a, state_b = whole_optimizer.state[a], resumed_optimizer.state[b]
        assert state_b["exp_avg"].dtype == torch.float32 and torch.equal(state_a["exp_avg_sq"], state_b["exp_avg_sq"])
    assert not torch.equal(next(whole.parameters()), next(LlamaForCausalLM(config).to(torch.bfloat16).parameters()))


def test_folded_clipping_equals_clip_grad_norm_then_the_step():
    """clip_gradients + step == torch.nn.utils.clip_grad_norm_ + step: bit for bit on fp32 weights (the same fp32
    product; and clipping changed them), within a bf16 rounding on bf16 ones (clip_grad_norm_ rounds the scaled
    bf16 gradient, ours keeps it fp32); the gradients themselves are left as they were, and the coefficient is used by one step only."""
    def run(dtype, folded, max_norm):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (300, 77)]
        optimizer = AdamWBf16SR(params, lr=1e-2, weight_decay=0.1)
        norms = []
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(dtype)
            raw = [p.grad.clone() for p in params]
            if folded:
                norms.append(optimizer.clip_gradients(params, max_norm))
                assert all(torch.equal(p.grad, r) for p, r in zip(params, raw))  # not scaled here
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm))
            optimizer.step()
            assert optimizer.clip_coefficient is None
        return params, norms

    results = {}
    for max_norm in (0.5, float("inf")):  # clipping every step; the norm alone
        plain, plain_norms = run(torch.float32, False, max_norm)
        folded, folded_norms = results[max_norm] = run(torch.float32, True, max_norm)
        assert all(torch.equal(a, b) for a, b in zip(plain, folded)) and plain_norms == folded_norms
    assert min(results[0.5][1]) > 0.5 and not torch.equal(results[0.5][0][0], results[float("inf")][0][0])
    plain, _ = run(torch.bfloat16, False, 0.5)
    folded, _ = run(torch.bfloat16, True, 0.5)
    for a, b in zip(plain, folded):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-3)
    sharded = AdamWBf16SR([torch.nn.Parameter(torch.zeros(2))])
    assert sharded.clip_gradients([], 1.0) is None  # no gradients (or DTensor ones): clip the usual way


def test_the_trainer_clips_in_the_update_and_trains_as_with_clip_grad_norm(tmp_path):
    """Through SFTTrainer (fp32 tiny Llama, a --max_grad_norm that clips every step), against the Trainer's own
    clipping (the same run with folding off): folded, the gradients the optimizer receives are never scaled (their
    norm at the optimizer step is the unclipped norm, where the Trainer's clipping leaves max_grad_norm), the logged
    grad_norm and the weights equal the unfolded run's, and the NaN guard still reads the norm. Watched from a
    callback at the optimizer step, so it holds whichever torch function a library clips with."""
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from sft.options.arguments import SFTTrainingArguments
    from sft.safety.guards import NonFiniteGuard
    from sft.trainer import SFTTrainer

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (12, 16),
                                                                        generator=torch.Generator().manual_seed(0))]
    max_norm = 0.1

    class GradientNorms(TrainerCallback):  # the norm of the gradients the optimizer is about to use
        def __init__(self):
            self.norms = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    class Unfolded(SFTTrainer):  # the Trainer's own clipping, for the reference run
        def _clipping_can_fold(self) -> bool:
            return False

    def train(output_dir, trainer_class):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        args = SFTTrainingArguments(output_dir=str(output_dir), optim="adamw_bf16_sr", use_cpu=True, report_to="none",
                                    max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                                    max_grad_norm=max_norm, logging_steps=1, save_strategy="no", seed=0)
        guard, seen = NonFiniteGuard(), GradientNorms()
        trainer = trainer_class(model=model, args=args, train_dataset=rows, callbacks=[guard, seen], guard=guard)
        trainer.train()
        norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
        return list(model.parameters()), norms, seen.norms, guard.checked_gradients

    plain, plain_norms, plain_seen, _ = train(tmp_path / "plain", Unfolded)
    folded, folded_norms, folded_seen, checked = train(tmp_path / "folded", SFTTrainer)
    assert min(plain_norms) > max_norm and checked  # every step clipped; the guard looked
    assert all(math.isclose(n, max_norm, rel_tol=1e-4) for n in plain_seen)  # the Trainer scaled the gradients
    assert all(math.isclose(s, n, rel_tol=1e-5) for s, n in zip(folded_seen, folded_norms))  # folded: left whole
    assert folded_norms == plain_norms
    assert all(torch.equal(a, b) for a, b in zip(plain, folded))


FSDP_WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from sft.speed.sr_adamw import AdamWBf16SR

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)

    def train(sharded):
        torch.manual_seed(0)  # 33 rows: uneven shards (17 + 16), so the second shard starts mid-tensor
        model = torch.nn.Sequential(torch.nn.Linear(48, 33), torch.nn.Linear(33, 64)).to(torch.bfloat16)
        if sharded:
            fully_shard(model)
        optimizer = AdamWBf16SR(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for i, p in enumerate(model.parameters()):
                grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if sharded else grad
            optimizer.step()
        states = [optimizer.state[p]["exp_avg_sq"] for p in model.parameters()]
        full = lambda t: t.full_tensor() if sharded else t.detach()
        return [full(p) for p in model.parameters()] + [full(s) for s in states]

    plain, sharded = train(False), train(True)
    if dist.get_rank() == 0:
        print(json.dumps({"equal": [torch.equal(a, b) for a, b in zip(plain, sharded)]}))
    from sft.parallel.distributed import exit_process
    exit_process(0)
""")


@pytest.mark.slow
def test_fsdp2_sharded_update_equals_the_unsharded_one(tmp_path):
    """Under FSDP2 (raw fully_shard, two gloo ranks) each rank updates its shard, drawing the random bits by the
    global element index: weights and states equal the one-process run bit for bit, uneven shards included.
    ~25 s on 2 cores (two processes' imports)."""
    from test_lowbit import two_gloo_ranks

    found = two_gloo_ranks(FSDP_WORKER, tmp_path)
    assert found["equal"] == [True] * 8, found
