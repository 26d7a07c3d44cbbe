import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specrl.config import DataConfig
from specrl.data import (
    DataError,
    PromptLoader,
    _tokenize,
    encode_prompt,
    format_prompts,
    load_prompts,
)
from specrl.data.files import read_examples
from specrl.toy_policy import build_tokenizer
from specrl.types import Example, Prompt

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "12+30="}],
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1+1="}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 1},
    },
]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_reads_verl_schema_from_jsonl_and_parquet(tmp_path):
    jsonl = _write_jsonl(tmp_path / "train.jsonl", VERL_ROWS)
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), parquet)
    for path in (jsonl, str(parquet)):
        examples = read_examples([path], "prompt", "reward_model.ground_truth")
        assert [e.ground_truth for e in examples] == ["42", "2"]
        assert examples[0].prompt == [{"role": "user", "content": "12+30="}]
        assert examples[0].data_source == "openai/gsm8k" and examples[1].extra_info == {"index": 1}


def test_plain_jsonl_with_answer_column(tmp_path):
    path = _write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "3+4=", "answer": 7}])
    (example,) = read_examples([path], "prompt", "answer")
    assert (example.prompt, example.ground_truth) == ("3+4=", "7")
    assert example.columns == {"answer": 7}  # every column but the prompt, for TRL functions


def test_chat_template_is_applied_when_the_tokenizer_has_one():
    tokenizer = build_tokenizer()
    example = Example(
        prompt=[{"role": "user", "content": "12+30="}], ground_truth="42", data_source="x"
    )
    assert encode_prompt(example, tokenizer).ids == tuple(tokenizer.encode("12+30="))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}#{% endfor %}"
    assert encode_prompt(example, tokenizer).ids == tuple(tokenizer.encode("12+30=#"))
    said = []  # message lists are not hashable: the split's checks must not need them to be
    prompts = _tokenize([example, example], tokenizer, DataConfig(), "train", said.append)
    assert [p.ids for p in prompts] == [tuple(tokenizer.encode("12+30=#"))] * 2 and not said


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
TEXT = Example(prompt="12+30=", ground_truth="42", data_source="x")
CHAT = Example(prompt=[{"role": "user", "content": "1+1="}, {"role": "user", "content": "2+2="}], ground_truth="2", data_source="x")  # fmt: skip


@pytest.mark.parametrize(
    ("template", "mode", "prompts", "said"),
    [
        # verl's convention: an instruct model sees its chat format, plain text wrapped as a message
        (TEMPLATE, "auto", ([{"role": "user", "content": "12+30="}], CHAT.prompt), "1 train and 0 val plain-text prompts are rendered through the model's chat template"),
        (TEMPLATE, True, ([{"role": "user", "content": "12+30="}], CHAT.prompt), "data.apply_chat_template=false feeds them as they are"),
        # TRL's plain-text convention: as is, and said, since a chat model may not answer it
        (TEMPLATE, False, ("12+30=", "1+1=\n2+2="), "1 train and 0 val plain-text prompts are fed as they are"),
        (None, "auto", ("12+30=", CHAT.prompt), "no chat template: 0 train and 1 val chat prompts are fed as their contents"),
        (None, False, ("12+30=", "1+1=\n2+2="), "0 train and 1 val chat prompts are fed as their contents joined"),
    ],
)  # fmt: skip
def test_the_prompt_format_follows_data_apply_chat_template_and_is_said(
    template, mode, prompts, said
):
    (train, val), note = format_prompts(([TEXT], [CHAT]), template, mode)
    assert (train[0].prompt, val[0].prompt) == prompts
    assert train[0].ground_truth == "42" and said in note and "\n" not in note


def test_nothing_is_said_when_prompts_already_fit_the_model():
    assert format_prompts(([CHAT], [CHAT]), TEMPLATE, "auto")[1] is None
    assert format_prompts(([TEXT], [TEXT]), None, "auto")[1] is None
    assert format_prompts(([TEXT], [TEXT]), None, False)[1] is None


def test_a_chat_template_asked_of_a_model_without_one_is_one_line():
    with pytest.raises(DataError, match="has no chat template; set "):
        format_prompts(([TEXT], [TEXT]), None, True)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("", "hold no rows"),
        (
            '{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4\n',
            "line 2 is not valid JSON",
        ),
        (
            '{"prompt": "1+1="}\n',
            "line 1 has no column 'answer' (columns: prompt); set data.answer_key",
        ),
        (
            '{"prompt": 5, "answer": 1}\n',
            "'prompt' must be text or a list of {role, content} messages",
        ),
    ],
)
def test_bad_dataset_files_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=None) as err:
        read_examples([str(path)], "prompt", "answer")
    assert message in str(err.value) and str(path) in str(err.value)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9", "answer": 1}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8"):
        read_examples([str(path)], "prompt", "answer")


def test_prompts_longer_than_max_prompt_length_are_rejected_or_filtered():
    cfg = DataConfig(train_size=50, val_size=20, max_prompt_length=9)  # "12345+67=" is 9 tokens
    with pytest.raises(
        DataError, match=r"longer than data\.max_prompt_length=9 .*data\.truncation=filter"
    ):
        load_prompts(cfg, build_tokenizer(), seed=0, log=pytest.fail)
    said = []
    train, val = load_prompts(
        cfg.model_copy(update={"truncation": "filter"}), build_tokenizer(), seed=0, log=said.append
    )
    assert 0 < len(train) < 50 and all(len(p.ids) <= 9 for p in train + val)
    assert f"dropped {50 - len(train)} of 50 train prompts longer than 9 tokens" in said[0]


def test_loader_is_seeded_reshuffles_each_epoch_and_restores_position():
    prompts = [Prompt((i,), Example(str(i), str(i), "x")) for i in range(10)]
    loader = PromptLoader(prompts, batch_size=4, shuffle=True, seed=3)
    epoch0 = loader.next_batch() + loader.next_batch()
    epoch1_first = loader.next_batch()  # the last partial batch of epoch 0 is dropped
    assert loader.epoch == 1 and len(set(p.ids for p in epoch0)) == 8
    again = PromptLoader(prompts, batch_size=4, shuffle=True, seed=3)
    assert again.next_batch() + again.next_batch() == epoch0
    resumed = PromptLoader(prompts, batch_size=4, shuffle=True, seed=3)
    resumed.load_state_dict({"epoch": 1, "position": 0})
    assert resumed.next_batch() == epoch1_first
    assert [p.ids for p in epoch1_first] != [p.ids for p in epoch0[:4]]


def test_prompt_id_is_a_hash_of_token_ids():
    a = Prompt((1, 2, 3), Example("a", "1", "x"))
    b = Prompt((1, 2, 3), Example("different text, same ids", "2", "y"))
    assert a.prompt_id == b.prompt_id != Prompt((1, 2), a.example).prompt_id


def test_prompts_without_a_known_token_are_rejected_or_filtered_and_lossy_ones_reported(tmp_path):
    rows = [
        {"prompt": "12+30=", "answer": "42"},
        {"prompt": "", "answer": "0"},  # empty
        {"prompt": "What?", "answer": "1"},  # no character of the built-in alphabet
        {"prompt": "Answer with \\boxed{}. What is 3+4?", "answer": "7"},  # loses its words
    ]
    files = _write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = DataConfig(train_files=files, val_files=files, answer_key="answer")
    with pytest.raises(
        DataError, match=r"2 of 4 train prompts have no token the tokenizer knows \(first: ''\)"
    ):
        load_prompts(cfg, build_tokenizer(), seed=0, log=lambda _: None)
    said = []
    train, _ = load_prompts(
        cfg.model_copy(update={"truncation": "filter"}), build_tokenizer(), seed=0, log=said.append
    )
    assert [p.example.prompt for p in train] == ["12+30=", "Answer with \\boxed{}. What is 3+4?"]
    assert "dropped 2 of 4 train prompts with no token the tokenizer knows" in said[0]
    assert "1 of 2 train prompts lose characters to the tokenizer" in said[1]
    assert "→ '3+4'" in said[1] and "builtin:smollm2-135m-instruct" in said[1]
    assert len([line for line in said if "train prompts lose characters" in line]) == 1  # once


def test_characters_a_tokenizer_drops_without_an_unknown_token_are_reported():
    """A tokenizer without an unknown token, which maps what it does not know to padding:
    the letters of "Ann has 13 cards" vanish, and the warning names them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", *"0123456789 "])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    said = []
    example = Example("Ann has 13 cards", "13", "words")
    _tokenize([example], tokenizer, DataConfig(), "train", said.append)
    assert len(said) == 1 and "1 of 1 train prompts lose characters" in said[0]
    assert "('Aacdhnrs'; first: 'Ann has 13 cards' → " in said[0]


def test_loader_peek_is_the_next_batch_across_epochs():
    prompts = list(range(10))  # any items: the loader only orders them
    loader = PromptLoader(prompts, 4, shuffle=True, seed=3)
    for _ in range(7):  # two batches per epoch: peeks cross epoch boundaries
        ahead = loader.peek()
        assert loader.peek() == ahead
        assert loader.next_batch() == ahead
