"""Record CSVs as spreadsheets and people write them: encodings, delimiters, odd rows, big seeds."""

import codecs

import numpy as np
import pytest

from affdiv.experiments.records import decode_text, is_sqlite, read_csv, write_csv

ROWS = "method,batch_size,seed,metric\r\naffine,16,0,0.5\r\nnorm_l2,32,1,0.25\r\n"
EXPECTED = [{"method": "affine", "batch_size": 16, "seed": 0, "metric": 0.5},
            {"method": "norm_l2", "batch_size": 32, "seed": 1, "metric": 0.25}]


@pytest.mark.parametrize("encoding, bom", [
    ("utf-8", b""), ("utf-8", codecs.BOM_UTF8), ("utf-16-le", codecs.BOM_UTF16_LE),
    ("utf-16-be", codecs.BOM_UTF16_BE), ("utf-32-le", codecs.BOM_UTF32_LE), ("utf-32-be", codecs.BOM_UTF32_BE),
])
def test_every_unicode_encoding_with_its_bom_reads_the_same(tmp_path, encoding, bom):
    path = tmp_path / "r.csv"
    path.write_bytes(bom + ROWS.encode(encoding))
    assert read_csv(path) == EXPECTED


@pytest.mark.parametrize("delimiter", [",", "\t", ";"])
def test_the_delimiter_is_the_one_of_the_header(tmp_path, delimiter):
    path = tmp_path / "r.csv"
    path.write_text(ROWS.replace(",", delimiter))
    assert read_csv(path) == EXPECTED


def test_header_names_are_stripped_and_extra_fields_are_named(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("method, batch_size , seed,metric\naffine,16,0,0.5\n")
    assert read_csv(path) == EXPECTED[:1]
    path.write_text("method,batch_size,seed,metric\naffine,16,0,0.5\naffine,16,1,0.5,oops,again\n")
    with pytest.raises(ValueError, match=f"{path} line 3: 2 more field\\(s\\) than the 4 columns of the header"):
        read_csv(path)


def test_seeds_are_exact_integers_however_large(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text(f"method,batch_size,seed,metric\naffine,16,{2**64 - 1},0.5\naffine,16,{2**64 - 2},0.5\n"
                    "affine,16,3.0,0.5\n")
    assert [r["seed"] for r in read_csv(path)] == [2**64 - 1, 2**64 - 2, 3]


def test_undecodable_text_names_the_file_the_encoding_and_the_byte():
    with pytest.raises(ValueError, match=r"f.csv: not valid utf-8 text \(byte 0xff at offset 2\)"):
        decode_text(b"ab\xffcd", "f.csv")
    with pytest.raises(ValueError, match=r"not valid utf-16 text"):
        decode_text(codecs.BOM_UTF16_LE + b"a\x00\x00\xd8", "f.csv")  # a lone surrogate
    header = "method,batch_size,seed,metric\n"
    for codec, name in (("utf-16-le", r"UTF-16 \(little-endian\)"), ("utf-16-be", r"UTF-16 \(big-endian\)"),
                        ("utf-32-le", r"UTF-32 \(little-endian\)")):
        # Latin; characters U+xx00 (a NUL byte each); a surrogate pair cut by the 4096-byte head
        for text in (header, "méthode,一,Ā,Привет\n", "a,😀\n" * 1000):
            with pytest.raises(ValueError, match=rf"^f\.csv: not UTF-8 text: it looks like {name} without a byte"):
                decode_text(text.encode(codec), "f.csv")
    for binary in (b"PK\x03\x04\x14\x00\x06\x00", header.encode() + b"\x00" * 7):  # an xlsx; a NUL-padded CSV
        with pytest.raises(ValueError, match=rf"^f\.csv: a binary file \(a NUL byte at offset {binary.index(0)}\), "
                                             "not a text CSV$"):
            decode_text(binary, "f.csv")


def test_written_records_read_back_bit_for_bit_with_missing_columns_empty(tmp_path):
    records = [{"method": "affine", "batch_size": 16, "seed": 0, "metric": 0.1 + 0.2, "lr_rule": "sqrt"},
               {"method": "affine", "batch_size": 32, "seed": 0, "metric": np.float64(1 / 3)}]  # no lr_rule
    path = write_csv(tmp_path / "r.csv", records)
    assert path.read_text().splitlines()[1:] == ["affine,16,0,0.30000000000000004,sqrt",
                                                 "affine,32,0,0.3333333333333333,"]
    assert read_csv(path) == [records[0], {**records[1], "lr_rule": ""}]


def test_is_sqlite_on_a_csv(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("method,batch_size,seed,metric\n")
    assert not is_sqlite(path)


def test_data_seed_is_typed_like_seed(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("method,batch_size,seed,metric,data_seed\naffine,8,1,0.5,1.0\naffine,8,2,0.5,\n")
    first, second = read_csv(path)
    assert (first["data_seed"], second["data_seed"]) == (1, "")  # an empty cell stays absent
    path.write_text("method,batch_size,seed,metric,data_seed\naffine,8,1,0.5,split-a\n")
    with pytest.raises(ValueError, match="line 2.*data_seed"):
        read_csv(path)
