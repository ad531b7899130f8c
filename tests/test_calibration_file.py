"""The user's own calibration text: a file that cannot be used is refused with one line before any weight is
quantized, a usable one is what the calibrated algorithms read, and the report names it by name, tokens and
SHA-256."""
import hashlib
import json

import pytest
import torch

from tests.conftest import run_main

# Words of the tiny Llama's vocabulary (tests/conftest.py), so that every word is one known token.
SENTENCE = "the capital of France is Paris . hello world , how are you ? "


def _text_file(tmp_path, repeats: int = 200, name: str = "calibration.txt"):
    path = tmp_path / name
    path.write_text(SENTENCE * repeats, encoding="utf-8")
    return path


def _refusal(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "quantizing" not in result.stderr  # refused before any weight was quantized
    return last


def _write_bad_file(kind: str, tmp_path):
    path = tmp_path / {"jsonl": "chats.jsonl", "no-messages": "chats.jsonl"}.get(kind, "calibration.txt")
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b" \n\n")
    elif kind == "binary":
        path.write_bytes(b"PK\x03\x04\x00\x00secret weights")
    elif kind == "not-utf8":
        path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    elif kind == "jsonl":
        path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": [oops\n')
    elif kind == "no-messages":
        path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "a private note"}\n')
    elif kind == "too-large":
        with open(path, "wb") as file:
            file.truncate(64 * 2**20 + 1)  # sparse: no 64 MB written
    elif kind == "too-short":
        path.write_text("hello world")
    return path


@pytest.mark.parametrize("kind, message", [
    ("missing", "does not exist"),
    ("directory", "is not a regular file"),
    ("empty", "is empty"),
    ("binary", "is binary, not UTF-8 text"),
    ("not-utf8", "is not UTF-8 text (an invalid byte at offset 3)"),
    ("jsonl", "line 3: not JSON"),
    ("no-messages", "line 2: no \"messages\" list"),
    ("too-large", "over the 64 MB limit"),
    ("too-short", "is 2 tokens by this model's tokenizer, fewer than its recipes read (xnnpack-8da4w: 512)"),
])
def test_a_calibration_file_that_cannot_be_used_is_refused_with_one_line(tiny_llama_dir, tmp_path, kind, message):
    path = _write_bad_file(kind, tmp_path) if kind != "missing" else tmp_path / "nowhere.txt"
    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-8da4w", "--out", str(out),
                      "--export-only", "--calibration-file", str(path))
    last = _refusal(result)
    assert message in last, last
    assert "private note" not in result.stderr and "secret" not in result.stderr  # the contents are never echoed
    assert not list(out.rglob("*.pte")) if out.exists() else True


def test_a_calibration_file_no_chosen_recipe_reads_is_refused(tiny_llama_dir, tmp_path):
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out",
                      str(tmp_path / "out"), "--export-only", "--calibration-file", str(_text_file(tmp_path)))
    assert "no chosen recipe reads a calibration text (xnnpack-fp32)" in _refusal(result)


def test_gptq_asks_a_calibration_file_for_its_own_token_count(tiny_checkpoint, tmp_path):
    from models.errors import UserFacingError
    from quant.calibration_file import read_calibration_file
    from recipes.registry import get_recipe
    from recipes.request import recipe_options, tokenized_calibration

    recipe = get_recipe("xnnpack-8da4w")
    options = {recipe.name: recipe_options(recipe, {"quant_algorithm": "gptq"})}
    with pytest.raises(UserFacingError, match="xnnpack-8da4w: 8192"):
        tokenized_calibration(read_calibration_file(_text_file(tmp_path)), tiny_checkpoint.tokenizer, [recipe],
                              options)


def test_a_jsonl_files_tokens_are_its_chats_through_the_chat_template(tmp_path):
    from quant.calibration_file import read_calibration_file
    from tests.conftest import _byte_level_tokenizer

    tokenizer = _byte_level_tokenizer()
    chats = [[{"role": "system", "content": "what is the capital ?"}, {"role": "user", "content": "hello world"},
              {"role": "assistant", "content": "the capital of France is Paris ."}],
             [{"role": "user", "content": "how are you ?"}, {"role": "assistant", "content": "hello"}]]
    path = tmp_path / "chats.jsonl"
    # one line as {"messages": [...]}, one as the bare list, a blank line between
    path.write_text(json.dumps({"messages": chats[0], "source": "ignored"}) + "\n\n" + json.dumps(chats[1]) + "\n")

    file = read_calibration_file(path).tokenized(tokenizer)
    rendered = "".join(tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats)
    assert list(file.ids) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert file.ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    assert file.chat_count == 2 and file.describe.startswith("chats.jsonl (calibration file: 2 chats")
    assert file.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_chats_for_a_model_without_a_chat_template_are_refused(tiny_checkpoint, tmp_path):
    from models.errors import UserFacingError
    from quant.calibration_file import read_calibration_file

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    with pytest.raises(UserFacingError, match="no chat template"):
        read_calibration_file(path).tokenized(tiny_checkpoint.tokenizer)


def _recording_algorithm(monkeypatch, read: list):
    """A calibrated algorithm that keeps the windows it is given, on both quantization paths."""
    from quant.algorithms import ALGORITHMS, Algorithm
    from quant.calibration import CALIBRATION_TOKENS

    def whole(module, search_config, windows):
        read.append(windows)

    def by_unit(search_config, windows):
        read.append(windows)
        return lambda unit, module: None

    monkeypatch.setitem(ALGORITHMS, "recording", Algorithm("recording", "keeps its calibration windows",
                                                           prepare_module=whole, prepare_by_unit=by_unit,
                                                           calibration_tokens=CALIBRATION_TOKENS))


def test_the_calibrated_algorithms_read_the_plain_text_files_windows(tiny_checkpoint, tmp_path, monkeypatch):
    from models.llama import build_exportable
    from quant.calibration import CALIBRATION_TOKENS, calibration_windows
    from quant.calibration_file import read_calibration_file
    from quant.quantize import UnitQuantizer, quantize_module
    from recipes.registry import get_recipe

    path = _text_file(tmp_path)
    file = read_calibration_file(path).tokenized(tiny_checkpoint.tokenizer)
    expected = tiny_checkpoint.tokenizer(SENTENCE * 200, add_special_tokens=False)["input_ids"][:CALIBRATION_TOKENS]
    assert torch.cat(calibration_windows(tiny_checkpoint.tokenizer, 64, file=file), dim=1)[0].tolist() == expected
    builtin = torch.cat(calibration_windows(tiny_checkpoint.tokenizer, 64), dim=1)[0].tolist()
    assert builtin != expected

    read: list = []
    _recording_algorithm(monkeypatch, read)
    options = {"quant_algorithm": "recording"}
    export_options = get_recipe("xnnpack-8da4w").export_options(64)
    whole = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, export_options)
    section, _ = quantize_module(whole, "8da4w", options, tiny_checkpoint.tokenizer, 64, file)
    quantizer = UnitQuantizer("8da4w", options, tiny_checkpoint.tokenizer, 64, calibration_file=file)
    assert [torch.cat(windows, dim=1)[0].tolist() for windows in read] == [expected, expected]
    assert section["calibration"] == {
        "text": "calibration.txt (calibration file: plain text)", "tokens": CALIBRATION_TOKENS,
        "file": "calibration.txt", "file_tokens": len(SENTENCE.split()) * 200,
        "file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert quantizer.calibration == section["calibration"]


def test_awq_on_a_calibration_file_records_it_and_differs_from_the_builtin_text(tiny_checkpoint, tmp_path):
    from models.llama import build_exportable
    from quant.calibration_file import read_calibration_file
    from quant.quantize import UnitQuantizer
    from recipes.registry import get_recipe

    file = read_calibration_file(_text_file(tmp_path)).tokenized(tiny_checkpoint.tokenizer)
    export_options = get_recipe("xnnpack-8da4w").export_options(64)
    states = []
    for calibration_file in (None, file):
        quantizer = UnitQuantizer("8da4w", {"quant_algorithm": "awq"}, tiny_checkpoint.tokenizer, 64,
                                  calibration_file=calibration_file)
        module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, export_options,
                                  transform_unit=quantizer)
        states.append((module.state_dict(), quantizer.section(module)["calibration"]))
    (builtin_state, builtin), (file_state, from_file) = states
    assert "file" not in builtin and builtin["text"].startswith("quant/calibration_text.txt")
    assert from_file["file"] == "calibration.txt" and from_file["file_sha256"] == file.sha256
    norm = "model.layers.0.input_layernorm.weight"  # AWQ folds its scales into the norm before the linears
    assert not torch.equal(builtin_state[norm], file_state[norm])


def test_pt2e_calibration_calls_are_the_files_first_tokens_from_position_zero(tiny_checkpoint, tmp_path):
    from quant.calibration import CALIBRATION_TOKENS, file_calibration_inputs
    from quant.calibration_file import read_calibration_file

    file = read_calibration_file(_text_file(tmp_path)).tokenized(tiny_checkpoint.tokenizer)
    inputs = file_calibration_inputs(file, 31)
    assert all(tokens.shape[1] <= 31 and input_pos.tolist() == [0] for tokens, input_pos in inputs)
    assert torch.cat([tokens for tokens, _ in inputs], dim=1)[0].tolist() == list(file.ids[:CALIBRATION_TOKENS])


def test_the_calibration_section_round_trips_and_stays_as_before_without_a_file():
    from recipes.output.report import QuantCalibration

    builtin = {"text": "quant/calibration_text.txt (...)", "tokens": 512, "search_products": "bf16"}
    assert QuantCalibration.from_dict(builtin, strict=True).to_dict() == builtin
    assert list(QuantCalibration.from_dict(builtin).to_dict()) == ["text", "tokens", "search_products"]
    with_file = {"text": "notes.txt (calibration file: plain text)", "tokens": 8192, "search_tokens": 512,
                 "file": "notes.txt", "file_tokens": 9000, "file_sha256": "ab" * 32}
    assert json.dumps(QuantCalibration.from_dict(json.loads(json.dumps(with_file)), strict=True).to_dict()) \
        == json.dumps(with_file)


def test_the_held_out_slice_is_the_files_end_past_what_calibration_read():
    from quant.calibration_file import HELDOUT_MAX_TOKENS, CalibrationFile

    def slice_of(tokens: int, read: int = 512) -> list[int]:
        return CalibrationFile("notes.txt", "0" * 64, ids=tuple(range(tokens))).heldout_ids(read)

    assert slice_of(2000) == list(range(1600, 2000))  # the last fifth
    assert slice_of(1400) == list(range(1120, 1400))
    assert slice_of(600) == []  # 88 tokens past the 512 read: too few for a figure
    assert slice_of(12000, read=8192) == list(range(12000 - HELDOUT_MAX_TOKENS, 12000))


def test_a_recipe_is_scored_on_the_calibration_files_held_out_slice_labelled_as_such(tiny_checkpoint, tmp_path):
    from models.llama import ExportOptions, build_exportable
    from quant.calibration_file import read_calibration_file
    from recipes.evaluation import fidelity
    from recipes.output.report import Fidelity
    from recipes.running.generate import eager_step

    file = read_calibration_file(_text_file(tmp_path)).tokenized(tiny_checkpoint.tokenizer)
    heldout = file.heldout_ids(512)
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict,
                              ExportOptions(64, attention="sdpa"), tie_output=True)
    step = eager_step(module)
    texts = [fidelity.eval_token_ids(tiny_checkpoint.tokenizer, text)[:200]
             for text in (fidelity.EVAL_TEXT, fidelity.HELDOUT_TEXT)]
    scored = [fidelity.score_text(step, ids, 64) for ids in (*texts, heldout)]
    reference = fidelity.EvalReference("eager-fp32", *scored[:2])
    assert "calibration_heldout" not in fidelity.recipe_fidelity(step, "eager-fp32", "fp32", 64, reference).to_dict()

    reference.calibration_heldout, reference.calibration_heldout_text = scored[2], file.heldout_describe(len(heldout))
    found = fidelity.recipe_fidelity(step, "eager-fp32", "fp32", 64, reference)
    figures = found.calibration_heldout
    assert figures.positions == len(scored[2].targets) and figures.perplexity_ratio == 1.0
    assert figures.text == (f"calibration.txt: its last {len(heldout)} tokens, held out of calibration (not a fixed "
                            "text: recipes compare on fidelity and fidelity.heldout)")
    written = found.to_dict()
    assert list(written)[-1] == "calibration_heldout" and Fidelity.from_dict(written) == found


def test_a_job_records_its_calibration_file_and_scores_its_held_out_slice(tiny_llama_dir, tmp_path):
    from recipes.pipeline.run import run
    from recipes.request import RunRequest

    path = _text_file(tmp_path, name="my notes.txt")
    summary = run(RunRequest(["xnnpack-8da4w"], tmp_path / "out", model=str(tiny_llama_dir), max_seq_len=64,
                             max_new_tokens=4, profile=False, calibration_file=path))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    calibration = report["quantization"]["calibration"]
    assert calibration["file"] == "my notes.txt" and str(tmp_path) not in json.dumps(calibration)
    assert calibration["file_tokens"] == len(SENTENCE.split()) * 200 and calibration["tokens"] == 512
    assert calibration["file_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert summary.recipes[0].quantization.calibration.file_sha256 == calibration["file_sha256"]
    fidelity = report["fidelity"]
    assert fidelity["text"].startswith("quant/eval_text.txt") and fidelity["heldout"]["text"].startswith(
        "quant/eval_text_heldout.txt")  # the fixed texts stay, so recipes compare
    assert fidelity["calibration_heldout"]["text"].startswith("my notes.txt: its last 560 tokens, held out")
    assert fidelity["calibration_heldout"]["perplexity_ratio"] > 0
