"""Multi-GPU strategies, as far as a CPU box allows: the consumer-card NCCL decision (mocked GPU names), the
all-reduce check between two real gloo processes, the host-RAM check of ZeRO-3 offload plans, the shipped
accelerate/DeepSpeed configs, and ZeRO-2/ZeRO-3 training on CPU through the shipped accelerate configs (save,
reload, compare with DeepSpeed's own consolidation of the checkpoint shards, resume). FSDP, fp16/bf16 and tensor
parallel need GPUs: bench/gpu_strategy_checks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, run_train

CONFIGS = REPO / "accelerate_configs"
DS_CONFIGS = REPO / "ds_configs"
# DeepSpeed JIT-compiles its shared-memory op at first use (~30-110 s on 2 cores): one cache for the whole suite
# (.ci/run exports the same path).
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


# ---- consumer cards --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, consumer", [
    ("NVIDIA GeForce RTX 4090", True), ("NVIDIA GeForce RTX 4080 SUPER", True), ("NVIDIA GeForce RTX 3090", True),
    ("NVIDIA GeForce RTX 5090", True), ("NVIDIA TITAN RTX", True), ("RTX 4090 D", True),
    ("NVIDIA H200", False), ("NVIDIA A100-SXM4-80GB", False), ("NVIDIA RTX A6000", False),
    ("NVIDIA RTX 6000 Ada Generation", False), ("NVIDIA L40S", False)])
def test_consumer_gpu_by_name(name, consumer):
    from sft.parallel.distributed import is_consumer_gpu

    assert is_consumer_gpu(name) is consumer


def test_nccl_env_for_three_4090s():
    from sft.parallel.distributed import decide_nccl_env

    decision = decide_nccl_env(["NVIDIA GeForce RTX 4090"] * 3, peer_access=None, env={})
    assert decision.env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert all("RTX 4090" in line and "peer-to-peer" in line for line in decision.reasons)


def test_nccl_env_left_alone_on_datacentre_gpus_and_single_gpu():
    from sft.parallel.distributed import decide_nccl_env

    assert decide_nccl_env(["NVIDIA H200"] * 2, peer_access=True, env={}).env == {}
    assert decide_nccl_env(["NVIDIA GeForce RTX 4090"], peer_access=None, env={}).env == {}  # nothing to talk to


def test_nccl_env_when_peer_access_is_missing():
    """A card the name table does not know, but torch.cuda.can_device_access_peer says no: same treatment."""
    from sft.parallel.distributed import decide_nccl_env

    decision = decide_nccl_env(["NVIDIA RTX A4000"] * 2, peer_access=False, env={})
    assert decision.env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert "cannot access each other" in decision.reasons[0]


def test_nccl_env_keeps_what_the_user_set():
    from sft.parallel.distributed import decide_nccl_env

    decision = decide_nccl_env(["NVIDIA GeForce RTX 4090"] * 2, peer_access=None, env={"NCCL_P2P_DISABLE": "0"})
    assert decision.env == {"NCCL_IB_DISABLE": "1"}
    assert any("keeping your NCCL_P2P_DISABLE=0" in line for line in decision.reasons)


def test_configure_nccl_env_sets_the_process_environment(monkeypatch, capsys):
    """The launch is data (sft.machine.Launch); what is decided is written to the environment, for NCCL."""
    import sft.parallel.distributed as distributed
    from sft.machine import Launch

    monkeypatch.setattr(distributed, "visible_gpu_names", lambda launch=None: ["NVIDIA GeForce RTX 4090"] * 3)
    monkeypatch.setattr(distributed, "gpus_have_peer_access", lambda: False)
    for var in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    distributed.configure_nccl_env(Launch(world_size=1))  # one process: nothing to configure
    assert "NCCL_P2P_DISABLE" not in os.environ
    distributed.configure_nccl_env(Launch(world_size=3, rank=1))
    assert os.environ["NCCL_P2P_DISABLE"] == "1" and os.environ["NCCL_IB_DISABLE"] == "1"
    assert capsys.readouterr().err == ""  # said by rank 0 only
    monkeypatch.delenv("NCCL_P2P_DISABLE")
    monkeypatch.delenv("NCCL_IB_DISABLE")
    decision = distributed.configure_nccl_env(Launch(world_size=3, nccl=(("NCCL_P2P_DISABLE", "0"),)))
    assert decision.env == {"NCCL_IB_DISABLE": "1"}  # the user's value, read at launch, is kept
    err = capsys.readouterr().err
    assert "NCCL: consumer GPUs (NVIDIA GeForce RTX 4090) have no peer-to-peer" in err
    assert "keeping your NCCL_P2P_DISABLE=0" in err


def test_visible_gpu_names_follow_cuda_visible_devices(monkeypatch):
    import accelerate.utils.environment as environment

    from sft.parallel.distributed import visible_gpu_names
    from sft.machine import Launch

    monkeypatch.setattr(environment, "get_gpu_info", lambda: (["GPU A", "GPU B", "GPU C"], 3))
    assert visible_gpu_names(Launch(cuda_visible_devices="2,0")) == ["GPU C", "GPU A"]
    assert visible_gpu_names(Launch()) == ["GPU A", "GPU B", "GPU C"]


def test_the_launch_is_read_from_the_launchers_environment():
    """What torchrun / accelerate launch set, as sft.machine.read_launch turns it into data."""
    from sft.machine import read_launch

    env = {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3", "RANK": "4", "LOCAL_RANK": "1", "ACCELERATE_USE_FSDP": "true",
           "CUDA_VISIBLE_DEVICES": "0,2", "NCCL_P2P_DISABLE": "1", "PATH": "/bin"}
    launch = read_launch(env)
    assert (launch.world_size, launch.local_world_size, launch.rank, launch.local_rank) == (6, 3, 4, 1)
    assert launch.launched and launch.fsdp and not launch.first
    assert launch.cuda_visible_devices == "0,2" and launch.nccl == (("NCCL_P2P_DISABLE", "1"),)
    assert launch.processes_here(6) == 3
    deepspeed = read_launch({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"})  # its launcher: no LOCAL_WORLD_SIZE
    assert deepspeed.local_world_size is None and deepspeed.processes_here(4) == 4 and deepspeed.first


def test_the_toolkits_own_settings_are_read_with_the_launch():
    """The other variables sft reads, read once into the Launch too (no module reads the environment itself)."""
    from sft.machine import read_launch

    unset = read_launch({})
    assert (unset.tensorboard_logging_dir, unset.xdg_cache_home) == (None, None)
    assert unset.fp8_compile and not unset.peft_input_cast and not unset.hub_proxied
    launch = read_launch({"TENSORBOARD_LOGGING_DIR": "/tb", "XDG_CACHE_HOME": "/cache", "SFT_FP8_COMPILE": "0",
                          "SFT_PEFT_INPUT_CAST": "1", "all_proxy": "socks5://proxy:1080"})
    assert (launch.tensorboard_logging_dir, launch.xdg_cache_home) == ("/tb", "/cache")
    assert not launch.fp8_compile and launch.peft_input_cast and launch.hub_proxied
    empty = read_launch({"TENSORBOARD_LOGGING_DIR": "", "XDG_CACHE_HOME": "", "HTTPS_PROXY": ""})  # empty: unset
    assert (empty.tensorboard_logging_dir, empty.xdg_cache_home, empty.hub_proxied) == (None, None, False)


def test_the_allreduce_advice_names_the_nccl_settings_nccl_got(monkeypatch):
    """The user's values from the launch and what configure_nccl_env added for consumer cards."""
    import sft.parallel.distributed as distributed
    from sft.machine import Launch

    monkeypatch.setattr(distributed, "visible_gpu_names", lambda launch=None: ["NVIDIA GeForce RTX 4090"] * 2)
    advice = distributed.nccl_advice(Launch(world_size=2, nccl=(("NCCL_P2P_DISABLE", "0"),)))
    assert "GPUs: NVIDIA GeForce RTX 4090, NVIDIA GeForce RTX 4090; NCCL_P2P_DISABLE=0, NCCL_IB_DISABLE=1." in advice
    alone = distributed.nccl_advice(Launch(world_size=1))  # one process: nothing added
    assert "NCCL_P2P_DISABLE=unset, NCCL_IB_DISABLE=unset." in alone


# ---- the all-reduce check, between two real gloo processes -----------------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from sft.parallel.distributed import DistributedCheckError, check_allreduce
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
    if sys.argv[3] == "zeros" and dist.get_rank() == 1:
        real = dist.all_reduce
        def broken(tensor, *args, **kwargs):  # what a broken peer-to-peer copy does: the sum arrives as zeros
            real(tensor, *args, **kwargs)
            if tensor.numel() > 100_000:
                tensor.zero_()
        dist.all_reduce = broken
    from sft.parallel.distributed import exit_process
    try:
        check_allreduce()
        print("all-reduce ok")
    except DistributedCheckError as e:
        print(f"error: {e}")
        exit_process(3)
    exit_process(0)  # gloo's threads can abort the interpreter's teardown of a finished run (seen in CI: -6)
""")


@pytest.mark.parametrize("mode", ["correct", "zeros"])
def test_allreduce_check_with_two_gloo_processes(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rendezvous = tmp_path / "rendezvous"
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(rendezvous), str(rank), mode], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    codes = [w.returncode for w in workers]
    if mode == "correct":
        assert codes == [0, 0], outputs
        assert all("all-reduce ok" in out for out in outputs)
    else:
        assert codes == [0, 3], outputs  # rank 0 got the right sum; rank 1 saw the zeros and says so
        message = outputs[1]
        assert "the all-reduce check failed on rank 1 of 2" in message
        assert "got 0, expected" in message
        assert "NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1" in message


def test_processes_without_a_backend_are_refused():
    """`accelerate launch --num_processes 2` on CPU with neither --use_cpu nor --ddp_backend: two processes that
    would each train alone (and log twice the loss). Seen on this box; now a clear error."""
    from accelerate.utils import DistributedType

    from sft.options.arguments import ConfigError
    from sft.parallel.distributed import check_data_parallel
    from sft.machine import Launch

    def args(world_size, kind):
        return SimpleNamespace(world_size=world_size, distributed_state=SimpleNamespace(distributed_type=kind))

    two = Launch(world_size=2, launched=True)
    with pytest.raises(ConfigError, match="each would train alone.*--use_cpu true"):
        check_data_parallel(args(2, DistributedType.NO), two)  # DDP config with --ddp_backend gloo only
    with pytest.raises(ConfigError, match="2 processes were started"):
        check_data_parallel(args(1, DistributedType.NO), two)  # DeepSpeed config with no backend: each sees world 1
    for kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.DEEPSPEED):
        check_data_parallel(args(2, kind), two)
    check_data_parallel(args(1, DistributedType.NO), Launch())


def test_one_process_trains_on_one_gpu(tmp_path, monkeypatch, capsys):
    """A single process on a multi-GPU machine (python sft/train.py, single_gpu.yaml) would otherwise get
    nn.DataParallel over every GPU and twice the batch: seen on two H200s, where a one-GPU reference run read 4 rows
    per step at --per_device_train_batch_size 2. Our TrainingArguments' n_gpu, which the Trainer reads, is at most
    one from the start (nothing rewrites it later); the run says so."""
    from transformers import TrainingArguments

    from sft.options.arguments import SFTTrainingArguments
    from sft.parallel.distributed import one_gpu_per_process

    for seen, trained in ((2, 1), (1, 1), (0, 0)):  # transformers' count: two GPUs, one (or a launch), CPU
        monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self, seen=seen: seen))
        args = SFTTrainingArguments(output_dir=str(tmp_path), report_to="none")
        assert (args.gpus_seen, args.n_gpu) == (seen, trained)
        assert args.train_batch_size == args.per_device_train_batch_size  # the global batch: not x GPUs
    alone = SimpleNamespace(gpus_seen=2, device="cuda:0")
    one_gpu_per_process(alone)
    assert "One process sees 2 GPUs: training on cuda:0 only" in capsys.readouterr().out
    for n in (0, 1):  # CPU, one GPU, and every distributed process (TrainingArguments gives each 1)
        one_gpu_per_process(SimpleNamespace(gpus_seen=n, device="cpu"))
    assert capsys.readouterr().out == ""


# ---- host RAM of ZeRO-3 offload plans --------------------------------------------------------------------------

def offload_args(ds_config: str, world_size: int = 2, bf16: bool = True):
    config = json.loads((DS_CONFIGS / ds_config).read_text())
    return SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config), world_size=world_size,
                           bf16=bf16, fp16=False)


def host(ram_gib: float, available_gib: float | None = None, **launch):
    """A machine with `ram_gib` of host RAM (what sft.machine.machine() reads, SFT_HOST_RAM_GIB included)."""
    from sft.machine import Launch, Machine

    return Machine(host_ram_gib=ram_gib, host_ram_available_gib=ram_gib if available_gib is None else available_gib,
                   launch=Launch(**launch))


def model_args(path, **kw):
    from sft.options.arguments import LoraArguments, ModelArguments

    return ModelArguments(model=str(path)), LoraArguments(**kw)


def test_parameter_count_from_the_config_alone(tiny_llama):
    """Meta-device count == the real model's count; LoRA count == what peft really adds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from sft.parallel.distributed import count_parameters

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    total, trainable = count_parameters(*model_args(tiny_llama))
    assert total == trainable == sum(p.numel() for p in model.parameters())
    total, trainable = count_parameters(*model_args(tiny_llama, lora=True, lora_r=8))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the llama default
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    assert trainable == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def deepseek_7b_config(path: Path) -> Path:
    """deepseek-llm-7b's shape as a config.json only: no weights are needed to check a plan."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=30,
                num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0).save_pretrained(path)
    return path


def test_offload_plan_of_a_7b_model_is_refused_on_a_small_machine(tmp_path):
    from sft.options.arguments import ConfigError
    from sft.parallel.distributed import check_offload_ram

    path = deepseek_7b_config(tmp_path / "7b")
    margs, largs = model_args(path)
    with pytest.raises(ConfigError) as caught:
        check_offload_ram(margs, largs, offload_args("zero3_offload.json"), host(64, 60))
    message = str(caught.value)
    # 6.91e9 parameters x (4 master + 8 Adam + 4 grad + 2 bf16 weights) bytes = 115.8 GiB
    assert "at least 115.8 GiB" in message
    assert "6.91B parameters" in message and "this machine has 64.0 GiB, 60.0 GiB available" in message
    assert "51.5 GiB Adam moments" in message and "12.9 GiB 16-bit working weights" in message
    assert "--lora" in message and "SFT_HOST_RAM_GIB" in message  # says what to do instead


def cpu_args(world_size: int = 1):
    return SimpleNamespace(device="cpu", world_size=world_size, deepspeed_plugin=None)


def test_a_model_larger_than_the_ram_of_a_gpu_less_machine_is_refused_before_loading(tmp_path, capsys):
    """Was: the kernel killed the process part-way through loading, with no error line."""
    from sft.options.arguments import ConfigError
    from sft.parallel.distributed import check_cpu_training_ram

    path = deepseek_7b_config(tmp_path / "7b")
    with pytest.raises(ConfigError) as caught:  # a full fine-tune in fp32 (no bf16 here): 4 x (1 + 3) B a param
        check_cpu_training_ram(*model_args(path), cpu_args(), host(64, 60))
    assert "about 103.0 GiB (6.91B parameters in 32-bit, 6.91B trained" in str(caught.value)
    assert "this machine has 64.0 GiB" in str(caught.value) and "--lora" in str(caught.value)
    need = check_cpu_training_ram(*model_args(path, lora=True), cpu_args(), host(64, 60))
    assert 25.7 < need < 26.5 and capsys.readouterr().err == ""  # LoRA: the fp32 weights and the adapter's few
    with pytest.raises(ConfigError, match=r"37.5M trained .*, in each of 3 processes.*choose a smaller model or fewer"):
        check_cpu_training_ram(*model_args(path, lora=True), cpu_args(3), host(64, 60))
    check_cpu_training_ram(*model_args(path, lora=True), cpu_args(), host(64, 20))
    assert capsys.readouterr().err.startswith("warning: training on the CPU holds the model in host RAM")
    gpu = SimpleNamespace(device="cuda:0", world_size=1, deepspeed_plugin=None)
    assert check_cpu_training_ram(*model_args(path), gpu, host(16, 16)) is None  # a GPU holds it


def test_offload_ram_can_be_given_for_machines_whose_ram_grows(tmp_path, monkeypatch, capsys):
    """SFT_HOST_RAM_GIB replaces what psutil reports, in the Machine read once (sft/machine.py)."""
    import sft.machine
    from sft.parallel.distributed import check_offload_ram

    path = deepseek_7b_config(tmp_path / "7b")
    monkeypatch.setenv("SFT_HOST_RAM_GIB", "256")
    sft.machine.machine.cache_clear()
    try:
        given = sft.machine.machine()
    finally:
        sft.machine.machine.cache_clear()  # the next reader sees the environment without the test's value
    assert given.host_ram_gib == given.host_ram_available_gib == 256
    check_offload_ram(*model_args(path), offload_args("zero3_offload.json"), given)
    assert "this machine has 256.0 GiB, 256.0 GiB available" in capsys.readouterr().out
    check_offload_ram(*model_args(path), offload_args("zero3_offload.json"), host(256, 256, rank=1))
    assert capsys.readouterr().out == ""  # reported by the first process only


def test_offload_plan_that_fits_passes_and_lora_needs_little(tmp_path, capsys):
    from sft.parallel.distributed import GIB, check_offload_ram

    path = deepseek_7b_config(tmp_path / "7b")
    estimate = check_offload_ram(*model_args(path, lora=True), offload_args("zero3_offload.json"), host(64, 60))
    assert 12.8 * GIB < estimate.total() < 13.5 * GIB  # bf16 weights of the frozen base + a small adapter's states
    assert "Host RAM: the DeepSpeed CPU-offload plan needs at least" in capsys.readouterr().out
    # Plans without offload are not checked at all.
    assert check_offload_ram(*model_args(path), offload_args("zero3.json"), host(1e-9)) is None
    assert check_offload_ram(*model_args(path), SimpleNamespace(deepspeed_plugin=None), host(1e-9)) is None


def test_offload_plan_share_per_machine(tmp_path):
    """Over two machines each holds half of the ZeRO partitions; a launcher that does not say how many processes
    run here (DeepSpeed's sets no LOCAL_WORLD_SIZE) counts as one machine."""
    from sft.parallel.distributed import estimate_offload
    from sft.machine import Launch

    path = deepseek_7b_config(tmp_path / "7b")
    six = offload_args("zero3_offload.json", world_size=6)
    estimate = estimate_offload(*model_args(path), six, Launch(world_size=6, local_world_size=3))
    assert estimate.node_share == 0.5
    assert estimate.total() == pytest.approx(0.5 * 18 * estimate.params)
    assert estimate_offload(*model_args(path), six, Launch(world_size=6)).node_share == 1.0


# ---- the shipped configs ---------------------------------------------------------------------------------------

TRAINER_SET = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
               "train_batch_size")


@pytest.mark.parametrize("name", ["zero2.json", "zero3.json", "zero3_offload.json", "autoep.json"])
def test_deepspeed_configs_leave_trainer_values_to_the_trainer(name):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = json.loads((DS_CONFIGS / name).read_text())
    for key in TRAINER_SET:
        assert config[key] == "auto", key
    assert config["bf16"]["enabled"] == config["fp16"]["enabled"] == "auto"
    assert config["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    zero = config["zero_optimization"]
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # model.safetensors, LoRA adapters
    if "offload" in name:
        assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
        assert config["optimizer"]["type"] == "AdamW"  # DeepSpeed's CPU Adam, not torch's on the CPU
        assert all(v == "auto" for v in config["optimizer"]["params"].values())
    # The Trainer fills every "auto" without a mismatch, in bf16, fp16 and fp32 alike.
    for precision in ({"bf16": True}, {"fp16": True}, {}):
        fields = dict(world_size=3, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0,
                      learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                      fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False, fp16_backend="auto",
                      fp16_opt_level="O1", half_precision_backend="auto", eval_strategy="no", save_on_each_node=False)
        args = SimpleNamespace(**{**fields, **precision})
        filled = HfTrainerDeepSpeedConfig(json.loads((DS_CONFIGS / name).read_text()))
        try:
            filled.trainer_config_process(args)
        except AttributeError as e:  # a TrainingArguments field this stand-in lacks
            pytest.fail(f"stand-in TrainingArguments needs {e}")
        assert not filled.mismatches, filled.mismatches
        assert filled.config["train_batch_size"] == 24
        assert filled.config["bf16"]["enabled"] is bool(precision.get("bf16"))
        assert filled.config["fp16"]["enabled"] is bool(precision.get("fp16"))


def load_accelerate_config(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(CONFIGS / name))


@pytest.mark.parametrize("name, processes", [
    ("single_gpu.yaml", 1), ("ddp.yaml", 3), ("fsdp.yaml", 3), ("zero2.yaml", 3), ("zero3.yaml", 3),
    ("zero3_offload.yaml", 3), ("tp.yaml", 2), ("multi_node.yaml", 6), ("autoep.yaml", 2)])
def test_accelerate_configs_load(name, processes):
    config = load_accelerate_config(name)
    assert config.num_processes == processes
    if config.distributed_type == "DEEPSPEED":
        ds = config.deepspeed_config
        # Everything else lives in the JSON (multi-node also says how each machine starts its processes).
        assert set(ds) <= {"deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher"}
        assert (REPO / ds["deepspeed_config_file"]).is_file()
        stage = json.loads((REPO / ds["deepspeed_config_file"]).read_text())["zero_optimization"]["stage"]
        assert ds["zero3_init_flag"] is (stage == 3)


def test_fsdp_config_shards_per_decoder_layer():
    from transformers import DeepseekV2ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

    fsdp = load_accelerate_config("fsdp.yaml").fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # = each model's _no_split_modules:
    assert LlamaForCausalLM._no_split_modules == ["LlamaDecoderLayer"]
    assert Qwen2ForCausalLM._no_split_modules == ["Qwen2DecoderLayer"]
    assert DeepseekV2ForCausalLM._no_split_modules == ["DeepseekV2DecoderLayer"]
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"  # checkpoints; the final save is consolidated


FSDP_PROBE = textwrap.dedent("""
    import json, os
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoConfig, AutoModelForCausalLM
    os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "true"  # what sft/train.py does with --activation_checkpointing
    plugin = FullyShardedDataParallelPlugin()  # as the Trainer's Accelerator builds it, from the launcher's env
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128))
    plugin.set_auto_wrap_policy(model)
    print(json.dumps({"version": plugin.fsdp_version, "state_dict_type": str(plugin.state_dict_type),
                      "activation_checkpointing": plugin.activation_checkpointing,
                      "wrap": sorted(c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"])}))
""")


def test_fsdp_yaml_through_the_launcher(tmp_path):
    """`accelerate launch --config_file accelerate_configs/fsdp.yaml`: the FSDP plugin it yields is FSDP2, wraps
    each decoder layer, keeps sharded checkpoints and takes activation checkpointing from the environment."""
    probe = tmp_path / "probe.py"
    probe.write_text(FSDP_PROBE)
    result = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                             str(CONFIGS / "fsdp.yaml"), "--num_processes", "1", str(probe)],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert found == {"version": 2, "state_dict_type": "StateDictType.SHARDED_STATE_DICT",
                     "activation_checkpointing": True, "wrap": ["LlamaDecoderLayer"]}


def test_fsdp_lora_adapter_is_saved_complete(fsdp_two_ranks):
    """FSDP2 + FSDP's activation checkpointing + LoRA, on two gloo processes (raw fully_shard, as accelerate
    applies it): peft derives the adapter's keys from module names, which carry the checkpoint wrapper's prefix
    while the state dict does not, so it saves an EMPTY adapter (seen on 2 x H200 with fsdp.yaml). After
    remove_checkpoint_wrappers (done by consolidate_fsdp_saves) it holds every tensor, equal to the trained ones.
    The ranks: conftest's fsdp_two_ranks (tests/fsdp_two_ranks_worker.py, part lora_checkpoint_wrappers)."""
    counts = fsdp_two_ranks["lora_checkpoint_wrappers"]
    assert "error" not in counts, counts.get("error")
    assert counts["as_is"] in (0, 8)  # 0 with peft 0.21: the bug; 8 once peft strips the wrapper's prefix itself
    assert counts["removed"] == 2 and counts["unwrapped"] == 8 and counts["equal"]  # 2 layers x q,v x A,B


def test_fsdp_settings_are_resolved_with_the_options(tmp_path, monkeypatch, capsys):
    """Under FSDP: the Trainer's --activation_checkpointing becomes FSDP's own, and gradient accumulation keeps
    gradients sharded (sync_each_batch) unless the user chose otherwise, decided once with the other derived
    options (sft/options/resolve.py), so the Trainer's arguments are final before it is built. Without FSDP
    nothing changes. sft/parallel/fsdp.py then only hands FSDP's checkpointing to accelerate's plugin (its
    environment variable) and says what changed."""
    from sft.machine import Launch, Machine
    from sft.options.arguments import parse_args, validate_setup
    from sft.parallel.fsdp import hand_over_to_fsdp

    data = str(REPO / "data" / "alpaca_demo.json")

    def resolved(launch: Launch, *extra: str):
        groups = parse_args(["--model", "m", "--dataset", data, "--output_dir", str(tmp_path), "--report_to", "none",
                             "--activation_checkpointing", "true", "--gradient_accumulation_steps", "4", *extra])
        validate_setup(*groups, machine=Machine(gpu_names=("H200",) * 2, gpu_memory_gib=(139.0,) * 2, bf16=True,
                                                launch=launch))
        return groups[3]

    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING", raising=False)
    plain = resolved(Launch(world_size=2, local_world_size=2, launched=True))
    assert plain.activation_checkpointing and plain.accelerator_config.gradient_accumulation_kwargs is None
    hand_over_to_fsdp(plain, launch=Launch(world_size=2))
    assert "FSDP_ACTIVATION_CHECKPOINTING" not in os.environ and capsys.readouterr().out == ""

    on = Launch(world_size=2, local_world_size=2, launched=True, fsdp=True)
    fsdp = resolved(on)
    assert not fsdp.activation_checkpointing and not fsdp.gradient_checkpointing
    assert fsdp.fsdp_activation_checkpointing
    assert fsdp.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    hand_over_to_fsdp(fsdp, launch=on)
    assert os.environ["FSDP_ACTIVATION_CHECKPOINTING"] == "true"
    out = capsys.readouterr().out
    assert "FSDP: --activation_checkpointing applied as FSDP's" in out and "sync_each_batch" in out
    chosen = resolved(on, "--accelerator_config", '{"gradient_accumulation_kwargs": {"sync_each_batch": false}}')
    assert chosen.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": False}
    monkeypatch.delenv("FSDP_ACTIVATION_CHECKPOINTING")
    lora = resolved(on, "--lora")  # LoRA keeps transformers' checkpointing: FSDP's wrappers hide the adapter
    assert lora.activation_checkpointing and not lora.fsdp_activation_checkpointing
    hand_over_to_fsdp(lora, launch=on)
    assert "FSDP_ACTIVATION_CHECKPOINTING" not in os.environ and "as transformers' own" in capsys.readouterr().out


def test_zero3_init_can_be_switched_off_for_a_one_process_reload():
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from sft.model.zero3 import zero3_init_disabled

    config = HfDeepSpeedConfig(json.loads((DS_CONFIGS / "zero3.json").read_text()))  # sets the global
    try:
        assert is_deepspeed_zero3_enabled()
        with zero3_init_disabled():
            assert not is_deepspeed_zero3_enabled()
        assert is_deepspeed_zero3_enabled()
    finally:
        unset_hf_deepspeed_config()
        del config


# ---- ZeRO-2 / ZeRO-3 training on CPU, through the shipped accelerate configs -----------------------------------

def launch_with(config: str, port: int) -> list[str]:
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [accelerate, "launch", "--config_file", str(CONFIGS / config), "--num_processes", "2",
            "--main_process_port", str(port)]


def short_run(model: Path, output: Path, *extra: str) -> list[str]:
    # --ddp_backend gloo: on a CPU box accelerate picks no backend for DeepSpeed and each rank would think it
    # is alone (world size 1) while DeepSpeed sees 2; gloo makes both agree. GPUs use NCCL as usual.
    return ["--model", str(model), "--dataset", str(REPO / "data" / "alpaca_demo.json"), "--max_samples", "64",
            "--max_length", "128", "--packing", "true", "--per_device_train_batch_size", "2", "--max_steps", "4",
            "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-2",
            "--lr_scheduler_type", "constant", "--report_to", "none", "--seed", "0", "--ddp_backend", "gloo",
            "--output_dir", str(output), *extra]


def run_deepspeed(config: str, port: int, args: list[str]):
    result = run_train(args, launcher=launch_with(config, port), env={"TORCH_EXTENSIONS_DIR": EXTENSIONS},
                       timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Training on 2 process(es)" in result.stdout, result.stdout[-2000:]
    return result


def tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def zero_checkpoint(checkpoint: Path) -> dict:
    """DeepSpeed's own consolidation of the ZeRO shards: independent of the Trainer's save path."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k.replace(".default.", "."): v for k, v in get_fp32_state_dict_from_zero_checkpoint(str(checkpoint)).items()}


@pytest.mark.slow
def test_zero3_and_zero2_full_fine_tune_on_cpu(tmp_path, tiny_llama):
    """accelerate_configs/zero3.yaml and zero2.yaml, 2 gloo ranks each. ZeRO-3 creates the model partitioned
    (zero.Init). Each final save is one model.safetensors equal to DeepSpeed's own consolidation of the last
    checkpoint's shards, which plain transformers loads. Both shardings train to the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    initial = tensors(tiny_llama / "model.safetensors")
    n = sum(v.numel() for v in initial.values())
    saved = {}
    for stage, port in (("zero3", 29621), ("zero2", 29627)):
        output = tmp_path / stage
        result = run_deepspeed(f"{stage}.yaml", port, short_run(tiny_llama, output))
        partitioned = f"ZeRO-3: model loaded partitioned (zero.Init): {n // 2:,} of {n:,} parameters on this rank"
        assert (partitioned in result.stdout) is (stage == "zero3"), result.stdout[-2000:]
        saved[stage] = tensors(output / "model.safetensors")
        reference = zero_checkpoint(output / "checkpoint-4")
        assert saved[stage].keys() == initial.keys()
        for key, value in saved[stage].items():
            assert torch.equal(value, reference[key]), key  # fp32 training: the gathered weights are the masters
            assert not torch.equal(value, initial[key]), f"{key} did not train"
        model = AutoModelForCausalLM.from_pretrained(output)
        assert torch.equal(model.state_dict()["model.layers.0.mlp.down_proj.weight"],
                           saved[stage]["model.layers.0.mlp.down_proj.weight"])
    gap = sum(float(((saved["zero3"][k] - saved["zero2"][k]) ** 2).sum()) for k in initial) ** 0.5
    travelled = sum(float(((saved["zero3"][k] - initial[k]) ** 2).sum()) for k in initial) ** 0.5
    assert gap < 1e-3 * travelled, f"ZeRO-3 and ZeRO-2 ended {gap:.3g} apart (training moved {travelled:.3g})"


@pytest.mark.slow
def test_zero3_lora_adapter_with_modules_trained_whole_is_complete_and_resumes(tmp_path, tiny_llama):
    """LoRA under ZeRO-3 with --lora_modules_to_save embed_tokens,lm_head: the adapter holds every A and B (peers save
    empty ones: trl #4416) and the two modules trained whole (peft copies each from its gathered ZeRO-3 partitions:
    the model is created partitioned), equal to the trained weights in the ZeRO shards (DeepSpeed's own
    consolidation), the modules changed from the base; checkpoint and final save pass the verified reload. A run
    resumed from checkpoint-2 ends with the same adapter, modules included, as the uninterrupted run.
    (Also what tests/test_modules_to_save.py's ZeRO-3 test checked, in one launch fewer.)"""
    import torch

    first, resumed = tmp_path / "first", tmp_path / "resumed"
    lora = ["--lora", "true", "--lora_dropout", "0", "--lora_modules_to_save", "embed_tokens,lm_head"]
    result = run_deepspeed("zero3.yaml", 29623, short_run(tiny_llama, first, *lora))
    assert "ZeRO-3: model loaded partitioned" in result.stdout and "(trained whole)" in result.stdout
    adapter = tensors(first / "adapter_model.safetensors")
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    whole = {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"}
    assert {k for k in adapter if ".lora_" not in k} == whole
    assert len(adapter) == 2 * 7 * layers + 2 and all(v.numel() > 0 for v in adapter.values())
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it trained
    shards = zero_checkpoint(first / "checkpoint-4")
    base = tensors(tiny_llama / "model.safetensors")
    for key, value in adapter.items():
        if key in whole:
            assert torch.equal(value, shards[key.replace(".weight", ".modules_to_save.weight")]), key
            assert not torch.equal(value, base[key.removeprefix("base_model.model.")]), f"{key} did not train"
        else:
            assert torch.equal(value, shards[key]), key

    result = run_deepspeed("zero3.yaml", 29625, short_run(tiny_llama, resumed, *lora, "--resume_from_checkpoint",
                                                         str(first / "checkpoint-2")))
    again = tensors(resumed / "adapter_model.safetensors")
    assert again.keys() == adapter.keys()
    for key in adapter:
        torch.testing.assert_close(again[key], adapter[key], rtol=1e-5, atol=1e-6, msg=key)
    state = json.loads((resumed / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and "ZeRO-3: model loaded partitioned" in result.stdout


EXIT_AFTER_A_GROUP = """
import atexit, sys
import torch.distributed as dist
from sft.parallel.distributed import exit_process
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
print("trained", flush=True)
exit_process(3)
"""


def test_exit_process_ends_the_group_runs_atexit_and_keeps_the_code(tmp_path):
    """After a multi-process run the command leaves without the interpreter's teardown (where gloo's threads
    can abort a finished run), but with the group destroyed, atexit handlers run, output flushed, code kept."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = tmp_path / "marker"
    result = subprocess.run([sys.executable, "-c", EXIT_AFTER_A_GROUP.format(port=port), str(marker)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.strip() == "trained" and marker.read_text() == "atexit ran"
    assert "terminate called" not in result.stderr


def test_an_error_is_said_once_by_the_first_process_and_by_a_rank_that_failed_alone(monkeypatch, capsys):
    """The first process prints a refusal at once; another rank waits (the launcher, seeing the first one fail,
    stops it during the wait: nothing more is printed) and prints its own only when the wait ends (it failed
    alone). A run with nothing to do is said by the first process only."""
    import time

    import sft.parallel.distributed
    from sft.parallel.distributed import report_error
    from sft.errors import ConfigError, NothingToDo

    waits = []
    monkeypatch.setattr(sft.parallel.distributed, "OTHER_RANK_WAIT_S", 0.01)
    report_error(ConfigError("--bf16 needs a GPU"), first=True)
    assert capsys.readouterr().err == "error: --bf16 needs a GPU\n"
    report_error(ConfigError("--dataset x: no such file"), first=False)
    assert capsys.readouterr().err == "error: --dataset x: no such file (rank 0)\n"  # this test's launch: rank 0

    def stopped(seconds):  # the launcher's SIGTERM arrives as KeyboardInterrupt (sft/safety/interrupts.py)
        waits.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", stopped)
    report_error(ConfigError("--bf16 needs a GPU"), first=False)
    report_error(NothingToDo("the run is complete"), first=False)
    assert capsys.readouterr().err == "" and waits == [0.01]
    report_error(NothingToDo("the run is complete"), first=True)
    assert capsys.readouterr().err == "the run is complete\n"
