"""The training data's fingerprint: cheap (sampled blocks of large files, a budget over many files), blind to where
the files lie, and telling a rewritten, resized, added, removed or touched file."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from boost_hf.data import fingerprint as fp
from boost_hf.data.fingerprint import DataSources, fingerprint_differences
from boost_hf.data.sources import training_sources


def lines(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f'{{"text": "document {i} {" ".join(str(rng.randint(0, 9)) for _ in range(30))}"}}\n' for i in range(count)]


def fingerprint_of(*paths) -> dict:
    return DataSources("test", tuple(map(str, paths))).fingerprint()


def test_a_shuffled_added_or_removed_file_differs_and_a_copy_or_a_touched_file_does_not(tmp_path: Path) -> None:
    data = tmp_path / "a" / "docs.jsonl"
    data.parent.mkdir()
    text = lines(200)
    data.write_text("".join(text))
    saved = fingerprint_of(data)
    assert saved["files"][0]["name"] == "docs.jsonl" and saved["files"][0]["size"] == data.stat().st_size

    copy = tmp_path / "elsewhere" / "docs.jsonl"
    copy.parent.mkdir()
    shutil.copy2(data, copy)  # staged to another disk, times kept
    assert fingerprint_differences(saved, fingerprint_of(copy)) == []

    random.Random(1).shuffle(text)
    copy.write_text("".join(text))  # the same lines in another order: same size
    os.utime(copy, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns))  # even with the old time
    (difference,) = fingerprint_differences(saved, fingerprint_of(copy))
    assert difference.startswith("docs.jsonl: sampled content ") and "size" not in difference and "modified" not in difference

    shutil.copy2(data, copy)
    os.utime(copy, ns=(0, data.stat().st_mtime_ns + 10**9))  # touched: the same content
    assert fingerprint_differences(saved, fingerprint_of(copy)) == []

    extra = tmp_path / "elsewhere" / "more.jsonl"
    extra.write_text("".join(lines(3)))
    shutil.copy2(data, copy)
    assert fingerprint_differences(saved, fingerprint_of(copy, extra)) == ["more.jsonl: added"]
    assert fingerprint_differences(fingerprint_of(copy, extra), saved) == ["more.jsonl: removed"]
    assert fingerprint_differences({"source": "x"}, {}) == []  # this run's sources unknown: nothing compared


def test_a_corpus_copied_without_its_times_moved_or_renamed_is_the_same_data(tmp_path: Path) -> None:
    """Staged to local scratch with ``cp`` (new modification times), the folder moved, a file renamed: the same sizes
    and sampled content in the same order, so no difference (before: "modified ..." refused each, and a renamed file
    read as one removed and one added). Files swapped (their order changed) or rewritten still differ."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part-{i}.jsonl").write_text("".join(lines(50, seed=i)))
    saved = fingerprint_of(*sorted(corpus.iterdir()))

    scratch = tmp_path / "scratch" / "job-4711"
    scratch.mkdir(parents=True)
    for path in sorted(corpus.iterdir()):
        shutil.copyfile(path, scratch / path.name)  # cp without -p: new times
        os.utime(scratch / path.name, ns=(0, path.stat().st_mtime_ns + 3600 * 10**9))
    assert fingerprint_differences(saved, fingerprint_of(*sorted(scratch.iterdir()))) == []
    moved = tmp_path / "elsewhere" / "wiki-corpus"
    shutil.move(str(scratch), moved)
    assert fingerprint_differences(saved, fingerprint_of(*sorted(moved.iterdir()))) == []
    (moved / "part-2.jsonl").rename(moved / "part-2-final.jsonl")  # still last in order
    assert fingerprint_differences(saved, fingerprint_of(*sorted(moved.iterdir()))) == []
    assert saved["digest"] == fingerprint_of(*sorted(moved.iterdir()))["digest"]  # the digest is the content's

    (moved / "part-0.jsonl").rename(moved / "part-9.jsonl")  # now read last: another order
    assert sorted(fingerprint_differences(saved, fingerprint_of(*sorted(moved.iterdir())))) == [
        "part-0.jsonl: removed", "part-2-final.jsonl: added", "part-2.jsonl: removed", "part-9.jsonl: added"]


def test_large_files_are_sampled_within_a_budget(tmp_path: Path, monkeypatch) -> None:
    """A file over 256 KiB is read in 16 blocks of 16 KiB (its first and last among them); over many files, about 4096
    blocks in all, at least 2 per file. A change inside a sampled block shows, its size and time as well."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(10 * fp.WHOLE_FILE_BYTES))
    reads = []
    real_open = open

    class CountedFile:
        """A file whose reads are recorded (their sizes)."""

        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def read(self, size=-1):
            reads.append(size)
            return self.file.read(size)

        def seek(self, offset):
            return self.file.seek(offset)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(fp, "open", CountedFile, raising=False)
    saved = fingerprint_of(big)
    assert reads == [fp.SAMPLE_BYTES] * fp.SAMPLES_PER_FILE
    reads.clear()
    many = [tmp_path / f"part-{i}.bin" for i in range(3000)]
    for path in many:
        path.write_bytes(b"x" * (fp.WHOLE_FILE_BYTES + 1))
    fingerprint_of(*many)
    assert reads == [fp.SAMPLE_BYTES] * 2 * 3000
    monkeypatch.undo()
    with open(big, "r+b") as f:
        f.seek(len(big.read_bytes()) - 10)  # inside the last block
        f.write(b"0123456789")
    assert "sampled content" in fingerprint_differences(saved, fingerprint_of(big))[0]


def test_training_sources_of_each_kind_of_source(tmp_path: Path) -> None:
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(lines(5)))
    valid.write_text("".join(lines(5, 1)))
    assert training_sources({"train": str(train), "validation": str(valid)}).files == (str(train),)
    assert training_sources(str(tmp_path / "*.jsonl")).files == (str(train), str(valid))
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text("{}")
    for name in ("data-00000-of-00001.arrow", "state.json", "cache-0a1b.arrow", "cache-0a1b.arrow.token_range.json"):
        (saved / "train" / name).write_text("x")
    assert [os.path.basename(f) for f in training_sources(str(saved)).files] == ["data-00000-of-00001.arrow", "state.json"]
    hub = training_sources("someone/corpus", config="en", load_kwargs={"revision": "v2"})
    assert hub.files == () and hub.description == "the Hub dataset 'someone/corpus' (configuration en, revision v2)"
    assert "Wikipedia sample" in training_sources(None).description
    assert fingerprint_differences(hub.fingerprint(), training_sources("someone/corpus").fingerprint()) == [
        "the source was the Hub dataset 'someone/corpus' (configuration en, revision v2), now the Hub dataset "
        "'someone/corpus'"]
