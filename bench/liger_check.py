"""Does Liger's kernel patch (Trainer's --use_liger_kernel) work here, and give the same loss and gradients?

A small Llama with LoRA on the GPU, packed rows (position_ids, no attention_mask), loss and gradients with and
without the patch. Prints `LIGER_OK` or `LIGER_FAIL <reason>`; bench/run_matrix.sh drops --use_liger_kernel from
its rows when this fails. Exit code 0 either way (it is a probe, not a test).
"""

from __future__ import annotations

import copy
import sys


def main() -> int:
    try:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.integrations.liger import apply_liger_kernel

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=8, use_cache=False)
        with torch.device("cuda"):
            base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], lora_dropout=0.0)
        plain = get_peft_model(copy.deepcopy(base), lora)
        fused = get_peft_model(copy.deepcopy(base), lora)
        fused.load_state_dict(plain.state_dict())
        apply_liger_kernel(fused, None)
        ids = torch.randint(0, 32000, (1, 1024), device="cuda")
        position_ids = torch.cat([torch.arange(600), torch.arange(424)]).unsqueeze(0).cuda()
        labels = ids.clone()
        labels[0, 600] = -100
        results = []
        for model in (plain, fused):
            out = model(input_ids=ids, position_ids=position_ids, labels=labels, use_cache=False)
            out.loss.backward()
            grads = torch.cat([p.grad.float().flatten() for n, p in model.named_parameters() if p.requires_grad])
            results.append((out.loss.float(), grads))
        (l0, g0), (l1, g1) = results
        loss_err = abs(l1 - l0).item() / abs(l0).item()
        grad_err = ((g1 - g0).norm() / g0.norm()).item()
        if not (loss_err < 1e-2 and grad_err < 5e-2):
            print(f"LIGER_FAIL loss rel err {loss_err:.2e}, grad rel err {grad_err:.2e}")
            return 0
        print(f"LIGER_OK loss rel err {loss_err:.1e}, grad rel err {grad_err:.1e}")
    except Exception as e:  # any failure means: do not use it in the bench
        print(f"LIGER_FAIL {type(e).__name__}: {str(e)[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
