"""Template edges (issue 27 item 5), each checked against the official template: a system text after the last turn,
R1 replies that do not open with `<think>\\n`, replies that are all reasoning under r1_distill_no_reasoning, system
texts under alpaca (written in place of its header, as LLaMA-Factory's alpaca template does). What training cannot
make equal to the saved template's prompts is counted in the data summary (the status of the examples concerned)."""

from __future__ import annotations

import pytest

from conftest import needs_shared
from test_reasoning import R1, runs, tokenizer_with
from test_templates import DEEPSEEK_V3, R1_DISTILL

pytestmark = needs_shared

EOS = "<｜end▁of▁sentence｜>"


def rows_of(name: str, tokenizer, messages: list[dict]) -> list[dict]:
    from sft.data.chat_templates import get_template
    from sft.data.tokenization import tokenize_examples

    return tokenize_examples(messages, tokenizer=tokenizer, template=get_template(name, tokenizer), max_length=4096)


@pytest.mark.parametrize("name, jinja", [("deepseek_v3", DEEPSEEK_V3), ("r1", R1)])
def test_a_system_text_after_the_last_turn_goes_first_as_the_official_template_puts_it(name, jinja):
    from sft.data.formats import messages_conversation

    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}, {"role": "system", "content": "Answer in English."}]}
    messages = messages_conversation(record, "test")["messages"]
    assert messages[-1] == record["messages"][-1]  # kept by the reader
    tokenizer = tokenizer_with(jinja)
    row = rows_of(name, tokenizer, messages)[-1]
    official = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert "Be brief.\n\nAnswer in English.<｜User｜>" in official
    assert row["input_ids"] == tokenizer(official, add_special_tokens=False)["input_ids"]


def test_r1_replies_without_think_are_trained_after_assistant_and_counted():
    """Such a reply follows `<｜Assistant｜>` alone, while the official (and saved) prompt ends `<think>\\n`: the
    examples say so in their status, which the data summary counts."""
    tokenizer = tokenizer_with(R1)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    row = rows_of("r1", tokenizer, messages)[0]
    start = runs(row)[0][0]
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<｜Assistant｜><think>\n")
    assert tokenizer.decode(row["input_ids"][:start]) == prompt.removesuffix("<think>\n")
    assert row["status"].startswith("replies not opening with '<think>\\n', trained after <｜Assistant｜> alone")
    thinking = [messages[0], {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"}]
    assert rows_of("r1", tokenizer, thinking)[0]["status"] == "ok"


def test_a_reply_that_is_all_reasoning_is_not_trained_without_reasoning_and_counted():
    tokenizer = tokenizer_with(R1_DISTILL)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nOnly musing.\n</think>"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"}]
    row = rows_of("r1_distill_no_reasoning", tokenizer, messages)[0]
    assert [tokenizer.decode(row["input_ids"][s:e]) for s, e in runs(row)] == ["4" + EOS]
    assert row["status"] == "replies that are all reasoning, not trained (r1_distill_no_reasoning)"
    # the context is the official template's: the empty answer as it shows it
    official = tokenizer.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(row["input_ids"]).startswith(official.removesuffix("<think>\n"))


def test_a_conversation_whose_only_reply_is_all_reasoning_is_counted_as_that_not_as_a_length_cut():
    """It trains nothing, so it is left out; the data summary counts it with the replies that are all reasoning,
    and --show_masks says so, not "no trained tokens" as if --max_length had cut its replies."""
    from sft.data.chat_templates import get_template
    from sft.data.dataset import finish, show_masks, tokenize
    from sft.data.templates import ALL_REASONING
    from sft.data.tokenization import NOTHING_TRAINED
    from sft.options.arguments import DataArguments

    tokenizer = tokenizer_with(R1_DISTILL)
    template = get_template("r1_distill_no_reasoning", tokenizer)
    musing = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nOnly musing.\n</think>"}]
    answered = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"}]
    args = DataArguments(max_length=4096, show_masks=1)
    conversations = [{"messages": musing, "source": "r1.jsonl:1"}, {"messages": answered, "source": "r1.jsonl:2"}]
    kept, counts, lengths = finish(tokenize(conversations, args, tokenizer, template), args)
    assert counts == {ALL_REASONING: 1, "ok": 1} and len(kept) == len(lengths) == 1
    shown = show_masks(conversations[:1], args, tokenizer, template)
    assert f"0 tokens, 0 trained ({ALL_REASONING})" in shown
    assert f"(nothing kept: {ALL_REASONING}, and no other reply to train on; it is not trained)" in shown
    # under --train_on_prompt every token trains, the musing too: kept, and not counted as untrained
    everything = DataArguments(max_length=4096, train_on_prompt=True)
    kept, counts, _ = finish(tokenize(conversations, everything, tokenizer, template), everything)
    assert counts == {"ok": 2} and len(kept) == 2
    # a reply cut away by --max_length is still said as such
    cut = DataArguments(max_length=4, overlong="cut", show_masks=1)
    assert finish(tokenize(conversations[1:], cut, tokenizer, template), cut)[1] == {NOTHING_TRAINED: 1}
    assert "(nothing kept: no reply token is left to train on (e.g. --overlong cut kept its first 4 tokens" in \
        show_masks(conversations[1:], cut, tokenizer, template)


# LLaMA-Factory's alpaca template (hiyouga/LLaMA-Factory, src/llamafactory/data/template.py): its default_system is
# the Stanford header, and without a format_system of its own register_template gives it the default formatter,
# StringFormatter(slots=["{{content}}"]): a record's system text replaces the header, written as given.
LLAMA_FACTORY_ALPACA_SYSTEM = "{{content}}"


def test_alpaca_writes_a_system_text_in_place_of_the_header_as_llama_factory_does():
    from sft.data.chat_templates import chat_template_for_saving
    from test_templates import CONVERSATIONS

    tokenizer = tokenizer_with(None)
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Traduis: chat",
                                                                  "input": "le chat noir"},
                   {"role": "assistant", "content": "the black cat"}, {"role": "user", "content": "And dog?"},
                   {"role": "assistant", "content": "dog"}]
    system = LLAMA_FACTORY_ALPACA_SYSTEM.replace("{{content}}", "Be brief.")
    expected = (bos + system + "### Instruction:\nTraduis: chat\n\n### Input:\nle chat noir\n\n### Response:"
                "the black cat" + eos + system + "### Instruction:\nAnd dog?\n\n### Response:dog" + eos)
    row = rows_of("alpaca", tokenizer, with_system)[0]
    assert tokenizer.decode(row["input_ids"]) == expected and row["status"] == "ok"
    assert [tokenizer.decode(row["input_ids"][s:e]) for s, e in runs(row)] == ["the black cat" + eos, "dog" + eos]
    tokenizer.chat_template = chat_template_for_saving("alpaca", tokenizer)  # the saved template writes the same
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == expected
    assert tokenizer.apply_chat_template(with_system[:2], tokenize=False, add_generation_prompt=True) == \
        expected[: expected.index("the black cat")]
    # No system text, or an empty one: the Stanford header, as before.
    for messages in (CONVERSATIONS[0], [{"role": "system", "content": ""}] + CONVERSATIONS[0]):
        row = rows_of("alpaca", tokenizer, messages)[0]
        assert tokenizer.decode(row["input_ids"]).startswith(bos + "Below is an instruction that describes a task.")
        assert row["status"] == "ok"


def test_families_documents_only_options_that_exist():
    import sft.model.families as families
    from sft.options.arguments import DataArguments

    assert "--reasoning" not in families.__doc__ and not hasattr(DataArguments, "reasoning")


def test_where_the_saved_v3_prompts_differ_from_training_as_docs_data_md_says():
    """Against the official V3 template: a call right after tool results is trained after `<｜tool▁output▁end｜>`,
    while the generation prompt there ends `<｜tool▁outputs▁end｜>`; a later call follows "\\n", never the
    `<｜Assistant｜>` a prompt after a question ends with."""
    from test_tool_calls import ROUNDS, SPECIAL, official_ids

    tokenizer = tokenizer_with(DEEPSEEK_V3)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    row = rows_of("deepseek_v3", tokenizer, ROUNDS)[0]
    k = max(i for i, m in enumerate(ROUNDS) if m.get("tool_calls"))  # the call straight after results
    assert ROUNDS[k - 1]["role"] == "tool"
    contexts = [tokenizer.decode(row["input_ids"][:s]) for s, _ in runs(row)]
    context = next(c for c in contexts if c.endswith(ROUNDS[k - 1]["content"] + "<｜tool▁output▁end｜>"))
    prompt = official_ids(tokenizer, ROUNDS[:k], add_generation_prompt=True, text=True)
    assert prompt == context + "<｜tool▁outputs▁end｜>"
    later = [tokenizer.decode(row["input_ids"][s:e]) for s, e in runs(row)][2]
    assert later.startswith("\n<｜tool▁call▁begin｜>") and not contexts[2].endswith("<｜Assistant｜>")
