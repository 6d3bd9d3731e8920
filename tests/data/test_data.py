"""Offline default data: tokenizer, corpus and the resumable DP data loader."""

from __future__ import annotations

import copy
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from torchtitan_autoparallel.data import dataset as dataset_module
from torchtitan_autoparallel.data.dataset import (
    DEFAULT_CORPUS_PATH,
    TokenDataLoader,
    build_dataloader,
)
from torchtitan_autoparallel.data.tokenizer import (
    DEFAULT_TOKENIZER_PATH,
    DataError,
    Tokenizer,
    load_tokenizer,
    resolve_tokenizer_path,
)

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "A second document, about lists and dictionaries.",
    "Third: every epoch visits each document once.",
    "Fourth document with a little more text in it than the others have.",
    "Fifth and last, short.",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


def take(loader: TokenDataLoader, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def stream_of(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Rebuild the token stream: each row is inputs plus its last label."""
    out: list[int] = []
    for x, y in batches:
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            out += row_x + row_y[-1:]
    return out


@pytest.fixture()
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(DOCS) + "\n", encoding="utf-8")
    return path


# --- tokenizer ---------------------------------------------------------------


def test_default_tokenizer_has_2048_ids_with_specials(tok: Tokenizer) -> None:
    assert tok.vocab_size == 2048
    assert {tok.bos_id, tok.eos_id} == {0, 1}
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<|bos|><|eos|>"


def test_tokenizer_round_trips_any_text(tok: Tokenizer) -> None:
    samples = ["Return the sum of a and b.", "  tabs\tand\nnewlines  ", "naïve — 日本語 🙂"]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.bos_id not in ids and tok.eos_id not in ids
    # BPE merges learned from the corpus: common English compresses well.
    assert len(tok.encode("Return the value of the attribute.")) <= 12


def test_tokenizer_loads_from_file_or_directory(tmp_path: Path, tok: Tokenizer) -> None:
    shutil.copy(DEFAULT_TOKENIZER_PATH, tmp_path / "tokenizer.json")
    for path in (tmp_path, tmp_path / "tokenizer.json", "default"):
        assert load_tokenizer(str(path)).encode("hello world") == tok.encode("hello world")


def test_missing_tokenizer_path_raises_one_line_data_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as info:
        load_tokenizer(str(missing))
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert str(missing) in message and "tokenizer.json" in message and "\n" not in message


# --- shipped corpus ----------------------------------------------------------


def test_shipped_corpus_is_prose_of_the_expected_size() -> None:
    text = DEFAULT_CORPUS_PATH.read_text(encoding="utf-8")
    assert 1_000_000 <= len(text.encode()) <= 3_000_000
    assert ">>>" not in text and ":func:`" not in text
    assert len(dataset_module.split_text_documents(text)) > 1000


# --- batches -----------------------------------------------------------------


def test_batch_shapes_and_shifted_labels(tok: Tokenizer) -> None:
    loader = build_dataloader(tok, "default", None, seq_len=64, local_batch_size=4)
    for x, y in take(loader, 3):
        assert x.shape == y.shape == (4, 64)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert int(x.max()) < tok.vocab_size and int(x.min()) >= 0


def test_stream_is_bos_ids_eos_and_wraps_around(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "one.txt"
    path.write_text(DOCS[0], encoding="utf-8")
    doc = [tok.bos_id, *tok.encode(DOCS[0]), tok.eos_id]
    loader = build_dataloader(tok, "text", str(path), seq_len=7, local_batch_size=3)
    got = stream_of(take(loader, 4))  # 96 tokens: several passes over one document
    assert got == (doc * (len(got) // len(doc) + 1))[: len(got)]
    assert loader.epoch >= 1


def test_global_batch_does_not_depend_on_dp_degree(tok: Tokenizer, text_file: Path) -> None:
    for dataset, path in (("default", None), ("text", str(text_file))):
        whole = take(build_dataloader(tok, dataset, path, 32, 8, 0, 1, seed=3), 4)
        ranks = [
            take(build_dataloader(tok, dataset, path, 32, 2, r, 4, seed=3), 4) for r in range(4)
        ]
        for step, (x, y) in enumerate(whole):
            assert torch.equal(torch.cat([ranks[r][step][0] for r in range(4)]), x)
            assert torch.equal(torch.cat([ranks[r][step][1] for r in range(4)]), y)
        # Ranks must not all read the same rows.
        assert not torch.equal(ranks[0][0][0], ranks[1][0][0])


@pytest.mark.parametrize("source", ["default", "tiny"])
def test_resume_matches_uninterrupted_run(tok: Tokenizer, text_file: Path, source: str) -> None:
    args = ("default", None) if source == "default" else ("text", str(text_file))
    straight = build_dataloader(tok, *args, seq_len=16, local_batch_size=4, seed=1)
    take(straight, 5)
    # Through JSON: checkpoints must be able to store the state as plain data.
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = build_dataloader(tok, *args, seq_len=16, local_batch_size=4, seed=1)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 6), take(straight, 6))


def test_resume_under_another_dp_degree_keeps_the_global_batch(tok: Tokenizer) -> None:
    single = build_dataloader(tok, "default", None, 16, 8, 0, 1)
    take(single, 3)
    state = single.state_dict()
    expected = next(single)[0]
    parts = []
    for rank in range(2):
        loader = build_dataloader(tok, "default", None, 16, 4, rank, 2)
        loader.load_state_dict(state)
        parts.append(next(loader)[0])
    assert torch.equal(torch.cat(parts), expected)


def test_state_for_another_seq_len_is_refused(tok: Tokenizer) -> None:
    state = build_dataloader(tok, "default", None, 16, 2).state_dict()
    with pytest.raises(DataError, match="seq_len"):
        build_dataloader(tok, "default", None, 32, 2).load_state_dict(state)


def test_epochs_reshuffle_documents_by_seed(tok: Tokenizer, text_file: Path) -> None:
    epoch_len = sum(len(tok.encode(d)) + 2 for d in DOCS)
    loader = build_dataloader(tok, "text", str(text_file), epoch_len - 1, 1, seed=0)
    epoch0, epoch1 = stream_of(take(loader, 1)), stream_of(take(loader, 1))
    assert sorted(epoch0) == sorted(epoch1)  # same documents...
    assert epoch0 != epoch1  # ...in another order
    other_seed = build_dataloader(tok, "text", str(text_file), epoch_len - 1, 1, seed=5)
    assert stream_of(take(other_seed, 1)) != epoch0


# --- local files -------------------------------------------------------------


def test_text_and_jsonl_sources_give_the_same_batches(
    tmp_path: Path, tok: Tokenizer, text_file: Path
) -> None:
    jsonl_dir = tmp_path / "jsonl"
    jsonl_dir.mkdir()
    # Split over two files (read in sorted order) with a blank line in one.
    lines = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)]
    (jsonl_dir / "a.jsonl").write_text("".join(lines[:2]) + "\n")
    (jsonl_dir / "b.jsonl").write_text("".join(lines[2:]))
    from_text = take(build_dataloader(tok, "text", str(text_file), 24, 2), 3)
    from_jsonl = take(build_dataloader(tok, "jsonl", str(jsonl_dir), 24, 2), 3)
    assert_same_batches(from_jsonl, from_text)
    decoded = tok.decode(stream_of(from_text))
    assert any(doc in decoded for doc in DOCS)


def test_missing_or_bad_local_sources_name_the_path(tmp_path: Path, tok: Tokenizer) -> None:
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="missing.txt"):
        build_dataloader(tok, "text", missing)
    with pytest.raises(DataError, match="needs dataset_path"):
        build_dataloader(tok, "jsonl", None)
    with pytest.raises(DataError, match="holds no .jsonl files"):
        build_dataloader(tok, "jsonl", str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        build_dataloader(tok, "jsonl", str(bad))
    with pytest.raises(DataError, match="dp_rank"):
        build_dataloader(tok, "default", None, 16, 2, dp_rank=2, dp_degree=2)


# --- Hugging Face streaming (offline: the network part is faked) ---------------


def fake_hf(monkeypatch: pytest.MonkeyPatch, docs: list[str]) -> None:
    def opener(name: str, config: str | None) -> dataset_module.DocumentOpener:
        return lambda epoch: iter(docs)

    monkeypatch.setattr(dataset_module, "open_hf_documents", opener)


def test_streamed_dataset_resumes_and_splits_like_local_ones(
    monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    records = [f"Record number {i} says {'hello ' * (i % 5)}" for i in range(12)]
    fake_hf(monkeypatch, records + ["  "])  # a blank record is skipped, not tokenized
    straight = build_dataloader(tok, "org/fake", None, 16, 4, seed=0)
    take(straight, 7)  # far enough to wrap around the 12 records
    assert straight.epoch >= 1
    resumed = build_dataloader(tok, "org/fake", None, 16, 4)
    resumed.load_state_dict(copy.deepcopy(straight.state_dict()))
    whole = take(straight, 3)
    assert_same_batches(take(resumed, 3), whole)
    fresh_whole = take(build_dataloader(tok, "org/fake", None, 16, 4), 2)
    halves = [take(build_dataloader(tok, "org/fake", None, 16, 2, r, 2), 2) for r in range(2)]
    assert torch.equal(torch.cat([halves[0][1][0], halves[1][1][0]]), fresh_whole[1][0])


def test_unreachable_hf_dataset_gives_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tok: Tokenizer
) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'org/fake' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    monkeypatch.setattr(dataset_module, "check_hub_reachable", lambda name: None)  # the Hub answers, the dataset fails
    with pytest.raises(DataError) as info:
        build_dataloader(tok, "org/fake", None, 16, 2)
    message = str(info.value)
    assert "'org/fake'" in message and "network" in message and "dataset='default'" in message


@pytest.mark.parametrize(
    "name,path,expected",
    [
        ("c4", None, ("allenai/c4", "en", "train")),
        ("c4_validation", None, ("allenai/c4", "en", "validation")),
        ("c4", "/data/c4_copy", ("/data/c4_copy", "en", "train")),  # a local copy, as torchtitan reads it
        ("wikitext", "wikitext-2-raw-v1", ("wikitext", "wikitext-2-raw-v1", "train")),
    ],
)
def test_torchtitan_dataset_names_stream_their_hub_datasets(
    monkeypatch: pytest.MonkeyPatch, tok: Tokenizer, name: str, path: str | None, expected: tuple
) -> None:
    asked: list[tuple] = []

    def load_dataset(hf_name: str, config: str | None, split: str, streaming: bool):
        asked.append((hf_name, config, split))
        assert streaming
        return [{"text": f"document {i} of the stream"} for i in range(40)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(dataset_module, "check_hub_reachable", lambda name: None)
    x, _ = next(iter(build_dataloader(tok, name, path, 16, 2)))
    assert asked[0] == expected and x.shape == (2, 16)


# --- torchtitan's dataset names offline ----------------------------------------


def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_dataset(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Hub was asked")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def json_lines_folder(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "c4_sample.json").write_text("".join(json.dumps({"text": d, "timestamp": "2019"}) + "\n" for d in docs))
    return folder


def test_c4_test_reads_torchtitans_folder_of_json_lines(monkeypatch, tmp_path: Path, tok: Tokenizer) -> None:
    no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)  # torchtitan's path is relative to its checkout
    json_lines_folder(tmp_path / "tests" / "assets" / "c4_test", DOCS * 5)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 5))
    titan = take(build_dataloader(tok, "c4_test", None, 16, 2), 3)
    ours = take(build_dataloader(tok, "jsonl", str(tmp_path / "docs.jsonl"), 16, 2), 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(titan, ours))


@pytest.mark.parametrize("name", ["c4", "c4_validation", "c4_test"])
def test_a_dataset_path_folder_is_read_locally(monkeypatch, tmp_path: Path, tok: Tokenizer, name: str) -> None:
    no_hub(monkeypatch)
    folder = json_lines_folder(tmp_path / "my_c4", DOCS * 5)
    x, _ = next(iter(build_dataloader(tok, name, str(folder), 16, 2)))
    assert x.shape == (2, 16) and x[0, 0] == tok.bos_id


def test_c4_test_without_its_folder_trains_on_the_shipped_corpus(monkeypatch, tmp_path: Path, tok: Tokenizer, caplog) -> None:
    no_hub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    batches = take(build_dataloader(tok, "c4_test", None, 16, 2), 2)
    shipped = take(build_dataloader(tok, "default", None, 16, 2), 2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, shipped))
    assert "torchtitan's test set), which is not here; training on the shipped corpus" in caplog.text
    with pytest.raises(DataError, match=r"dataset_path '.*nowhere' of dataset 'c4_test' is not a folder"):
        build_dataloader(tok, "c4_test", str(tmp_path / "nowhere"), 16, 2)


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1"}])
def test_a_hub_dataset_without_network_is_one_line_at_once(monkeypatch, tok: Tokenizer, env: dict) -> None:
    import time

    no_hub(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"Hugging Face dataset 'allenai/c4' is on the Hub, .*; accepted: .*dataset = 'default'") as info:
        build_dataloader(tok, "c4", None, 16, 2)
    assert time.perf_counter() - start < 5 and "\n" not in str(info.value)


def test_torchtitans_test_tokenizer_path_falls_back_to_the_shipped_one(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_tokenizer_path("./tests/assets/tokenizer") == DEFAULT_TOKENIZER_PATH
    (tmp_path / "tests" / "assets" / "tokenizer").mkdir(parents=True)
    shutil.copy(DEFAULT_TOKENIZER_PATH, tmp_path / "tests" / "assets" / "tokenizer" / "tokenizer.json")
    assert resolve_tokenizer_path("./tests/assets/tokenizer") == Path("tests/assets/tokenizer/tokenizer.json")


def test_a_stand_in_warning_is_logged_once_by_rank_0(monkeypatch, tmp_path: Path, caplog) -> None:
    from torchtitan_autoparallel.data import tokenizer as tokenizer_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tokenizer_module, "_WARNED", set())
    monkeypatch.delenv("RANK", raising=False)
    resolve_tokenizer_path("tests/assets/tokenizer")  # the launcher's check: quiet, and no note kept
    assert "test tokenizer" not in caplog.text
    monkeypatch.setenv("RANK", "0")  # the rank, forked from the launcher, says it once
    resolve_tokenizer_path("tests/assets/tokenizer")
    resolve_tokenizer_path("tests/assets/tokenizer")
    assert caplog.text.count("(torchtitan's test tokenizer) is not here; using the shipped tokenizer") == 1
