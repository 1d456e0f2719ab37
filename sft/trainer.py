"""SFTTrainer: the Hugging Face Trainer with what this toolkit adds to a training step, as methods it overrides.

TRL's SFTTrainer and Axolotl's trainer builders work this way: nothing is patched onto a live Trainer, so the
order of what happens in a step is the Trainer's own, held by code:

- `compute_loss`: the loss from the labelled tokens' last hidden states (`labelled_token_loss`: Liger's fused
  kernel, or `--chunked_loss`'s torch chunks, sft/speed/chunked_loss.py) instead of the model's loss over whole
  logits; then the MoE routers' balance loss (sft/model/moe.py) added to a training micro-batch's loss.
- `compute_loss` under `--sequence_parallel`: the same labelled-token loss from this rank's slice of each row, and
  the row's mean over the slices (sft/speed/sequence_parallel_loss.py).
- `compute_loss` under `--offload_activations`: what the forward saves outside the checkpointed layers (their
  checkpoints) waits in pinned host RAM until the backward needs it, copied there and back on a side stream beside
  the compute, the next layer's checkpoint brought back while this one's backward runs
  (sft/speed/activation_offload.py).
- `_clip_grad_norm`: with `--optim adamw_bf16_sr`, the clipping's scaling is handed to the optimizer's own pass
  over the gradients (sr_adamw.py `clip_gradients`) instead of another read and write of every gradient.
- `_get_grad_norm`: the NaN guard (sft/safety/guards.py) sees the total gradient norm just computed, before the
  optimizer step, instead of reading every gradient again.
- `_track_num_input_tokens`: the real-token count (tokens/s, MFU) from the collator's count made on the host
  (sft/data/packing.py NUM_INPUT_TOKENS) instead of a count on the GPU read back with `.item()`, which made the host
  wait for each micro-batch's backward and left the GPU idle while it then issued the optimizer step and the next
  forward. Across processes each rank keeps its count on the host and one all-reduce sums them when a log or a
  checkpoint reads it (`sum_tokens_over_ranks`, from `log` and `_save_checkpoint`), where the Trainer gathered and
  read back each micro-batch's count. A callback reading `state.num_input_tokens_seen` between logs sees the count
  of the last log (bench/train_throughput.py's clock reads `tokens_on_this_rank` instead, summed once at the end).
- `compute_loss` and `prediction_step` (`model_inputs`): the collator's host-made keys leave the batch before the
  model sees it; packed rows get their block-diagonal mask built from the collator's documents
  (sft/speed/packed_mask.py) instead of transformers finding them (a host wait at each forward), and the
  labelled-token loss picks its tokens at the collator's positions instead of by a boolean mask (another); the MoE
  balance loss takes the real tokens and their sequences from the collator too (sft/model/moe.py).
- FSDP2 with FP8 all-gather (a full fine-tune under `--fp8`, tensorwise scales): the weights' FP8 scales computed
  right after each optimizer step, in one all-reduce (sft/speed/fp8_training.py `Float8ScalesAfterStep`, added
  here because it belongs to how this model is sharded, as the progress callbacks belong to the Trainer's).
- `get_optimizer_cls_and_kwargs`: builds `adamw_bf16_sr` and gives torchao's low-bit AdamW its `--optim_args` as
  numbers.
- `train` and `compute_loss` under `--neftune_noise_alpha` (NEFTune): the noise on the input embeddings scaled by
  each token's own conversation (sft/model/neftune.py), in place of the Trainer's hook, which scales it by the
  packed row: attached for the training, handed each training batch's sequence lengths.
- `create_optimizer`: under `--loraplus_lr_ratio` (LoRA+), the B matrices in groups of their own at that ratio
  times the learning rate (sft/model/lora_plus.py).
- `create_scheduler`: the Trainer's schedule, as a scheduler whose resume keeps this run's schedule (the rule:
  after resuming at step N, the learning rate is this run's schedule at N, N+1, ...), so that a finished run
  resumed with a higher --max_steps goes on along the longer schedule instead of taking a step at the old
  schedule's final rate (0 for linear and cosine).
- `push_to_hub` (`--push_to_hub`): the final folder is uploaded after save_final has checked it
  (sft/safety/hub_push.py), not as the Trainer's save_model ends; checkpoints upload as the Trainer does.
- TensorBoard's callback runs after ours, so that it logs what ours add to the logs; the console's progress
  callback is ours (sft/report/progress.py): one short line per log instead of the metric dicts.

The overridden private methods are checked against the installed transformers before the Trainer is built
(sft/safety/private_names.py): a release that renames them stops with one error line instead of training on
without the guard or the folded clipping.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import PrinterCallback, ProgressCallback, Trainer
from transformers.integrations import TensorBoardCallback

from sft.data.packing import (COLLATOR_KEYS, CU_SEQ_LENS, DOCUMENT_IDS, LABELLED_POSITIONS, NOISE_LENGTHS,
                              NUM_INPUT_TOKENS)
from sft.data.tokenization import IGNORE
from sft.machine import is_first_process
from sft.model.lora_plus import split_b_matrices
from sft.model.moe import RouterBalance
from sft.model.neftune import NoisyEmbeddings, noise_line
from sft.report.progress import ConsolePrinter, ConsoleProgress
from sft.safety.guards import NonFiniteGuard
from sft.safety.private_names import CLIP_GRAD_NORM, GET_GRAD_NORM, SAVE_CHECKPOINT, TRACK_NUM_INPUT_TOKENS, expect
from sft.speed.activation_offload import PREFETCH, OffloadedActivations
from sft.speed.chunked_loss import LossFn
from sft.speed.packed_mask import packed_causal_mask
from sft.speed.varlen_attention import batch_kwargs as varlen_batch_kwargs
from sft.speed.fp8_training import Float8ScalesAfterStep, gathers_in_fp8
from sft.speed.sequence_parallel_loss import mean_over_slices, sequence_parallel_group
from sft.speed.lowbit import LOW_BIT_OPTIMIZERS, SR_ADAMW
from sft.speed.sr_adamw import AdamWBf16SR, optim_arg_pairs, optimizer_kwargs


class SFTTrainer(Trainer):
    """`Trainer(...)` plus: `labelled_token_loss` (a LossFn, or None for the model's own loss), `balance` (the MoE
    routers' RouterBalance, or None), `guard` (the NonFiniteGuard among the callbacks, or None)."""

    overridden = (CLIP_GRAD_NORM, GET_GRAD_NORM, TRACK_NUM_INPUT_TOKENS, SAVE_CHECKPOINT)

    @classmethod
    def check_overrides(cls) -> None:
        """The Trainer's private methods we override are what we built on (train.py asks before any model loads)."""
        for private in cls.overridden:
            expect(private)

    def __init__(self, *args, labelled_token_loss: LossFn | None = None, balance: RouterBalance | None = None,
                 guard: NonFiniteGuard | None = None, offload_prefetch: int = PREFETCH, loraplus_lr_ratio: float = 0.0,
                 **kwargs):
        self.check_overrides()
        super().__init__(*args, **kwargs)
        self.labelled_token_loss = labelled_token_loss
        self.balance = balance
        self.guard = guard
        self.offload_prefetch = offload_prefetch  # --offload_activations: saved tensors brought back ahead
        self.loraplus_lr_ratio = loraplus_lr_ratio  # --loraplus_lr_ratio: the B matrices' learning rate, times
        # This rank's real tokens of this session by the collator's host count (None: the Trainer counts), and how
        # many of them are in state.num_input_tokens_seen
        self.tokens_on_this_rank: int | None = None
        self.tokens_summed = 0
        # Read once (after the Trainer's own set-up, Liger's forward included): whether the forward can keep the
        # logits of one position only while the labelled-token loss projects the rest.
        self.keeps_one_logit = "logits_to_keep" in inspect.signature(_causal_lm(self.model).forward).parameters
        if self.pop_callback(TensorBoardCallback):  # after ours, so that it logs what ours add
            self.add_callback(TensorBoardCallback)
        for library, ours in ((ProgressCallback, ConsoleProgress), (PrinterCallback, ConsolePrinter)):
            if self.pop_callback(library):  # the one the Trainer chose (--disable_tqdm), in our form
                self.add_callback(ours)
        if gathers_in_fp8(self.model):  # FSDP2's FP8 all-gather: the weights' scales after each optimizer step
            self.add_callback(Float8ScalesAfterStep)
        # NEFTune: our hook (train), not the Trainer's, which its train() registers when this attribute is set and
        # which scales the noise by the packed row instead of each conversation
        alpha, self.neftune_noise_alpha = self.neftune_noise_alpha, None
        self.noise = NoisyEmbeddings(alpha) if alpha else None
        if self.noise and is_first_process():
            print(noise_line(alpha, "seq_lengths" in getattr(self.train_dataset, "column_names", ())), flush=True)

    def train(self, *args, **kwargs):
        """The Trainer's training, with NEFTune's hook on the input embeddings throughout (--neftune_noise_alpha)."""
        noise = self.noise.attached(self.model.get_input_embeddings()) if self.noise else contextlib.nullcontext()
        with noise:
            return super().train(*args, **kwargs)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs) -> None:
        """Nothing here: the Trainer's save_model calls this as its save ends, on every process, before save_final
        (sft/safety/checkpoints.py) has reloaded and checked the files, and its own upload would save the model
        again first. sft/safety/hub_push.py uploads the final folder once it is checked, from the main process.
        The uploads of checkpoints during training stay the Trainer's (--hub_strategy)."""
        return None

    # ---- the loss ----------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        positions = inputs.get(LABELLED_POSITIONS) if isinstance(inputs, dict) else None
        batch = inputs  # the collator's keys kept: the balance loss reads its token groups there
        inputs = self.model_inputs(inputs)
        training = model.training
        capture = self.balance.capture() if training and self.balance else contextlib.nullcontext()
        if self.noise:  # NEFTune: this training batch's sequence lengths scale its noise
            self.noise.lengths = batch.get(NOISE_LENGTHS) if training and isinstance(batch, dict) else None
        with capture, self._offloaded_activations(training):
            if training and "shift_labels" in inputs:  # --sequence_parallel: a labelled_token_loss is set
                loss, outputs = self._slice_loss_from_hidden_states(model, inputs)
            elif training and self.labelled_token_loss is not None and "labels" in inputs:
                loss, outputs = self._loss_from_hidden_states(model, inputs, num_items_in_batch, positions)
            else:
                loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                     num_items_in_batch=num_items_in_batch)
        if training and self.balance:
            loss = self._with_balance_loss(loss, batch, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, *args, **kwargs):
        return super().prediction_step(model, self.model_inputs(inputs), *args, **kwargs)

    def model_inputs(self, inputs):
        """The batch as the model takes it: without the collator's host-made keys (sft/data/packing.py), and with
        packed rows' mask built from their documents (sft/speed/packed_mask.py), which the collator gives only
        where the model's attention takes that mask (sft/train.py: builds_packed_mask); elsewhere their position_ids
        let transformers find the documents itself. Under --attn_implementation varlen the documents' start
        offsets go to the attention as the kernel's arguments instead (sft/speed/varlen_attention.py)."""
        documents = inputs.get(DOCUMENT_IDS) if isinstance(inputs, dict) else None
        starts = inputs.get(CU_SEQ_LENS) if isinstance(inputs, dict) else None
        inputs = without_collator_keys(inputs)
        if documents is not None:
            inputs["attention_mask"] = packed_causal_mask(_causal_lm(self.model).config, documents,
                                                          self.model.get_input_embeddings().weight.dtype)
        if starts is not None:
            inputs.update(varlen_batch_kwargs(starts, inputs["input_ids"].shape[-1]))
        return inputs

    def _track_num_input_tokens(self, inputs):
        count = inputs.get(NUM_INPUT_TOKENS) if isinstance(inputs, dict) else None
        # --sequence_parallel's batches (shift_labels) are slices, each holding its whole rows' count: the Trainer
        # counts those
        if count is None or self.args.include_num_input_tokens_seen != "non_padding" or "shift_labels" in inputs:
            return super()._track_num_input_tokens(inputs)  # it reads the token tensors only
        self.tokens_on_this_rank = (self.tokens_on_this_rank or 0) + count

    def sum_tokens_over_ranks(self) -> None:
        """This rank's host count since the last sum joins `state.num_input_tokens_seen`: with several processes,
        summed over them by one all-reduce, where the Trainer gathered each micro-batch's count and read it back
        (a wait for the GPU per micro-batch). Called where the count is read: each log (evaluation's and the
        final metrics' included) and each checkpoint (trainer_state.json), which every rank reaches together."""
        local = (self.tokens_on_this_rank or 0) - self.tokens_summed
        self.tokens_summed += local
        if self.args.world_size > 1 and self.args.include_num_input_tokens_seen == "non_padding":
            local = int(self.accelerator.reduce(torch.tensor(local, device=self.args.device), reduction="sum"))
        self.state.num_input_tokens_seen += local

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.sum_tokens_over_ranks()
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        self.sum_tokens_over_ranks()
        super()._save_checkpoint(model, trial)

    def _offloaded_activations(self, training: bool):
        """--offload_activations: what the forward saves for the backward outside the checkpointed layers (their
        checkpoints: each layer's input) goes to pinned host RAM and comes back as the backward reaches it, copied
        on a side stream: at long rows a layer computes for far longer than its checkpoint takes over PCIe (0.25 GB
        a layer at 32k tokens), so the copies hide behind the compute. Without CUDA the hooks keep every tensor."""
        if not (training and getattr(self.args, "offload_activations", False)):  # plain TrainingArguments too
            return contextlib.nullcontext()
        return self.activation_offload()

    def activation_offload(self) -> OffloadedActivations:
        """The saved-tensor hooks of one training forward (a subclass may copy otherwise: the CPU tests do); the
        model's own tensors stay on the GPU."""
        return OffloadedActivations(model=self.model, prefetch=self.offload_prefetch)

    def _loss_from_hidden_states(self, model, inputs: dict, num_items_in_batch, positions=None):
        """The causal-LM loss of the labelled tokens from the last hidden states: the model runs without its
        labels (so it builds no loss over whole logits) and keeps the logits of one position only. Scaled as the
        Trainer scales a model's own loss: over `num_items_in_batch` where the model takes it, times the processes
        where tokens are averaged across devices. `positions`: the collator's LABELLED_POSITIONS, which pick the
        labelled tokens without a wait for the GPU."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        causal_lm = _causal_lm(self.accelerator.unwrap_model(model))
        if self.keeps_one_logit:
            inputs["logits_to_keep"] = 1
        with last_hidden_state_of(causal_lm) as last:
            outputs = model(**inputs)
        items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        # Under the mixed precision the model's forward ran in (accelerate wraps only the forward): the norm's
        # output meets the lm_head there, as it would inside the model.
        with self.accelerator.autocast():
            where = {} if positions is None else {"positions": positions}
            loss = self.labelled_token_loss(last.hidden_state, causal_lm.lm_head, labels, items, **where)
        if self.args.average_tokens_across_devices and items is not None:  # as Trainer.compute_loss does
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return loss, outputs

    def _slice_loss_from_hidden_states(self, model, inputs: dict):
        """--sequence_parallel: this rank holds one slice of each row and its `shift_labels` (sft/parallel/
        sequence_parallel.py). The labelled-token loss of the slice, summed, then the row's mean over every slice's
        labelled tokens, as the Trainer's own SP loss weights them (which would project the slice's whole logits,
        and train with N times the gradient: mean_over_slices)."""
        inputs = dict(inputs)
        targets = inputs.pop("shift_labels")
        inputs.pop("labels", None)
        causal_lm = _causal_lm(self.accelerator.unwrap_model(model))
        if self.keeps_one_logit:
            inputs["logits_to_keep"] = 1
        with last_hidden_state_of(causal_lm) as last:
            outputs = model(**inputs)
        with self.accelerator.autocast():
            loss_sum = self.labelled_token_loss(last.hidden_state, causal_lm.lm_head, targets, 1, shifted=True)
        labelled = (targets != IGNORE).sum()  # summed over the slices on the GPU: never read on the host
        stage = self.accelerator.state.deepspeed_plugin.zero_stage
        return mean_over_slices(loss_sum, labelled, sequence_parallel_group(), stage), outputs

    def _with_balance_loss(self, loss: torch.Tensor, inputs: dict, num_items_in_batch) -> torch.Tensor:
        """The routers' balance loss joins the micro-batch's loss at the Trainer's scale: when the loss is already
        normalised over the accumulated batch, the Trainer will not divide by the accumulation steps, so the balance
        loss is divided here. Added after the multiplication by the processes, so DDP/DeepSpeed's averaging makes it
        the mean over ranks. The logged `loss` includes it (as Mixtral's does); `moe/aux_loss` says how much."""
        aux = self.balance.loss(inputs)
        if aux is None:
            return loss
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # the Trainer's own rule (training_step)
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if scaled:
            aux = aux / max(1, getattr(self, "current_gradient_accumulation_steps", 1))
        return loss + aux.to(loss.device, loss.dtype)

    # ---- clipping and the guard --------------------------------------------------------------------------------

    def _clip_grad_norm(self, model):
        """adamw_bf16_sr: the norm as clip_grad_norm_ computes it, its scaling deferred into the optimizer's update,
        where the gradients are whole tensors and nothing acts between clipping and the step (no fp16 loss scaler;
        DDP or one process). Otherwise (another optimizer, sharded gradients, FSDP, DeepSpeed) the Trainer's."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper
        if isinstance(optimizer, AdamWBf16SR) and self._clipping_can_fold():
            norm = optimizer.clip_gradients(list(model.parameters()), self.args.max_grad_norm)
            if norm is not None:
                return norm
        return super()._clip_grad_norm(model)

    def _clipping_can_fold(self) -> bool:
        from accelerate.utils import DistributedType

        return self.accelerator.scaler is None and self.accelerator.distributed_type in (
            DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.guard is not None:
            self.guard.saw_norm(grad_norm)
        return grad_norm

    # ---- the optimizer and the learning-rate schedule -----------------------------------------------------------

    def create_optimizer(self, model=None):
        """The Trainer's optimizer; under --loraplus_lr_ratio its B matrices in groups of their own at that many
        times the learning rate (sft/model/lora_plus.py), before the scheduler reads each group's rate."""
        made = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if made and self.loraplus_lr_ratio:
            moved = split_b_matrices(optimizer, self.model if model is None else model, self.loraplus_lr_ratio)
            if is_first_process():
                print(f"LoRA+: {moved} B matrices learn at {self.loraplus_lr_ratio:g}x the learning rate "
                      f"(--loraplus_lr_ratio)", flush=True)
        return optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        made = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if made and type(scheduler) is LambdaLR:  # every schedule of transformers' get_scheduler but the plateau one
            self.lr_scheduler = scheduler = ScheduleOfThisRun(scheduler.optimizer, scheduler.lr_lambdas)
        return scheduler

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        if args.optim == SR_ADAMW:
            optim_args = dict(optim_arg_pairs(args.optim_args))
            return AdamWBf16SR, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                                 "eps": args.adam_epsilon, **optimizer_kwargs(optim_args, args.seed)}
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if str(getattr(args.optim, "value", args.optim)) in LOW_BIT_OPTIMIZERS and \
                isinstance(kwargs.get("block_size"), str):
            kwargs = {**kwargs, "block_size": int(kwargs["block_size"])}  # transformers passes --optim_args as text
        return cls, kwargs


class ScheduleOfThisRun(LambdaLR):
    """The Trainer's schedule (the same lambdas, so the same rates), which a resume continues instead of replacing.

    On resume the Trainer builds the schedule for this run's options, then loads the checkpoint's scheduler state
    over it, and with it the checkpoint's last learning rate: a run that finished at step 4 of a 4-step linear
    schedule resumed to 8 steps trained step 5 at that rate, 0 (its weights unchanged), and then jumped back up the
    8-step schedule. Here the state brings only the step count: after loading, the rate is this run's schedule (its
    --learning_rate, --lr_scheduler_type, warmup and length) at the checkpoint's step. With the options unchanged
    that is the rate the checkpoint had, so a resumed run stays bit-identical to an uninterrupted one."""

    def load_state_dict(self, state_dict: dict) -> None:
        base_lrs = list(self.base_lrs)  # this run's --learning_rate, not the checkpoint's
        super().load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.lr_lambdas)})  # keep ours
        self.base_lrs = base_lrs
        self.last_epoch -= 1
        self.step()  # the rate of this run's schedule at the checkpoint's step, set on the optimizer too


class last_hidden_state_of(contextlib.AbstractContextManager):
    """Holds the decoder's last hidden state (after its final norm: what the lm_head reads) from the forward run
    inside the block, taken by a forward hook on the decoder (`get_decoder()`). Not `output_hidden_states=True`:
    that returns every layer's hidden state, and the mixed-precision forward wrapper converts each to fp32
    (at 16k tokens of a 7B model, 30 x 0.25 GB more: a 24 GB card's margin)."""

    def __init__(self, causal_lm):
        self.decoder = causal_lm.get_decoder()
        self.hidden_state: torch.Tensor | None = None

    def _keep(self, module, args, output) -> None:
        self.hidden_state = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def __enter__(self):
        self.handle = self.decoder.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()
        if exc[0] is None and self.hidden_state is None:
            raise RuntimeError(f"{type(self.decoder).__name__} ran no forward: no last hidden state for the loss")


def without_collator_keys(inputs):
    """The batch without the collator's host-made keys (its token count, labelled positions, documents)."""
    if isinstance(inputs, dict) and any(key in inputs for key in COLLATOR_KEYS):
        return {k: v for k, v in inputs.items() if k not in COLLATOR_KEYS}
    return inputs


def _causal_lm(model):
    """The causal LM under a peft wrapper (its lm_head, its forward's parameters)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
