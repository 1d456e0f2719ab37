"""Merge a trained LoRA adapter into its base model and save a plain Hugging Face model.

    python -m sft.tools.merge output/my-lora output/my-merged [--dtype bfloat16] [--push_to_hub you/my-merged]

The merged model is checked against the adapter on a fixed batch before anything is written; `--push_to_hub`
uploads it, with a model card, once written (the token and repository checked before anything loads).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None, prog: str = "python -m sft.tools.merge") -> int:
    from sft.report.console import ToolParser

    parser = ToolParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", help="directory of the trained adapter (the training --output_dir)")
    parser.add_argument("output", help="directory for the merged model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved merged weights (merging itself runs in float32)")
    parser.add_argument("--push_to_hub", metavar="NAME", help="upload the merged model to this Hugging Face Hub "
                                                               "repository (<user or organization>/<name>)")
    parser.add_argument("--private", action="store_true", help="with --push_to_hub: a new repository is private")
    args = parser.parse_args(argv)
    adapter, output = Path(args.adapter), Path(args.output)
    from sft.tools.trained_dirs import check_trained_dir
    from sft.errors import UserFacingError
    from sft.safety import hub_push

    try:
        check_trained_dir(adapter, adapter_only=True)
        if args.push_to_hub:  # before anything loads: the token, the network, the repository
            hub_push.ensure_repo(args.push_to_hub, hub_push.get_token(), args.private or None)
    except UserFacingError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        print(f"error: {output} exists and is {'a file' if not output.is_dir() else 'not empty'}; choose a new "
              f"directory.", file=sys.stderr)
        return 2
    created = not output.exists()
    try:  # before anything loads: a place the merged model cannot be written is said now
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: cannot create {output} ({e.strerror}: {e.filename}); choose a directory you can write to.",
              file=sys.stderr)
        return 2

    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from sft.model.loading import resolve_model_path
    from sft.safety.run_dir import QUANTIZED_BASE

    if (adapter / QUANTIZED_BASE).is_file():  # a --qlora adapter (sft/model/loading.py: record_quantized_base)
        quant = json.loads((adapter / QUANTIZED_BASE).read_text())
        print(f"note: this adapter was trained on a 4-bit ({quant.get('bnb_4bit_quant_type') or quant.get('quant_type', '?')}) base; it is "
              f"merged into the unquantized base, so the merged model's logits differ from the 4-bit model "
              f"trained by the quantization error (docs/strategies.md, QLoRA).", flush=True)
    from sft.model.rope_scaling import rope_record

    # the base as it was trained (--rope_scaling): the merged model's config keeps the scaled RoPE
    tuned = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32, use_safetensors=True,
                                                     **rope_record(adapter))
    probe = torch.randint(0, tuned.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tuned(input_ids=probe, use_cache=False).logits
        merged = tuned.merge_and_unload()
        got = merged(input_ids=probe, use_cache=False).logits
    error = ((got - expected).norm() / expected.norm()).item()
    if error > 1e-4:
        if created:
            output.rmdir()
        print(f"error: the merged model's logits differ from the adapter's (relative error {error:.2e}); "
              "nothing was written.", file=sys.stderr)
        return 1
    try:
        merged.to(getattr(torch, args.dtype)).save_pretrained(output)
        tokenizer_source = adapter if (adapter / "tokenizer_config.json").is_file() else \
            resolve_model_path(tuned.peft_config["default"].base_model_name_or_path)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(output)
    except KeyboardInterrupt:  # a half-written model must not pass for a merged one (output was empty before)
        for path in [output] if created else list(output.iterdir()):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        print(f"\nstopped (Ctrl-C) while writing {output}: the partial model was removed, the adapter is untouched. "
              f"Run the same command again.", file=sys.stderr)
        return 130
    print(f"Merged model ({args.dtype}, logits match the adapter: relative error {error:.1e}): {output}")
    if args.push_to_hub:
        base = tuned.peft_config["default"].base_model_name_or_path
        model_card(args.push_to_hub, base).save(output / "README.md")
        try:
            print(f"Uploaded to {hub_push.upload(args.push_to_hub, output, hub_push.get_token())}")
        except UserFacingError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
    return 0


def model_card(name: str, base: str):
    """The merged model's card: its base (where that is a hub id) and how it was made."""
    from huggingface_hub import ModelCard

    from sft.safety.hub_push import is_hub_id

    meta = f"base_model: {base}\n" if is_hub_id(base) else ""
    return ModelCard(f"---\n{meta}library_name: transformers\ntags:\n- deepseek-sft\n- lora-merged\n---\n\n"
                     f"# {name.split('/')[-1]}\n\n{base} with a LoRA adapter trained by deepseek-sft merged in; the "
                     f"merged model's logits were checked against the adapter's on a fixed batch.\n")


if __name__ == "__main__":
    sys.exit(main())
