"""The built-in model's converted folder: the GGUF is read once, and the folder then gives the same checkpoint."""
from pathlib import Path

from models.sources.builtin import CACHE_ENV, converted_folder, save_converted
from models.sources.checkpoint import builtin_gguf_path, load_checkpoint


def test_builtin_model_loads_from_its_converted_folder_with_the_ggufs_weights(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    from_gguf = load_checkpoint(None)
    folder = converted_folder(builtin_gguf_path())
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [folder.name]  # no partial folder left
    from_folder = load_checkpoint(None)

    assert from_folder.source == from_gguf.source == "builtin"
    assert from_folder.id == from_gguf.id and from_folder.path == from_gguf.path == str(builtin_gguf_path())
    assert from_folder.eos_token_ids == from_gguf.eos_token_ids
    assert from_folder.parameters == from_gguf.parameters and from_folder.tied and from_gguf.tied
    assert set(from_folder.state_dict) == set(from_gguf.state_dict) - {"lm_head.weight"}
    for name in from_folder.state_dict:
        assert from_folder.state_dict[name].equal(from_gguf.state_dict[name]), name
    for text in ["The capital of France is", "héllo 世界 <|im_start|>user\nhi<|im_end|>"]:
        assert from_folder.tokenizer.encode(text) == from_gguf.tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert (from_folder.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == from_gguf.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    differing = {k for k, v in from_gguf.config.to_dict().items() if from_folder.config.to_dict().get(k) != v}
    assert differing <= {"_name_or_path"}


class _FailingTokenizer:
    def save_pretrained(self, folder):
        raise OSError("No space left on device")


def test_a_failed_conversion_leaves_no_folder(tiny_checkpoint, tmp_path):
    import copy

    broken = copy.copy(tiny_checkpoint)
    broken.tokenizer = _FailingTokenizer()
    target = tmp_path / "cache" / "builtin-0123"
    assert save_converted(broken, target) is False
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_unwritable_cache_is_not_an_error(tiny_checkpoint, tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    assert save_converted(tiny_checkpoint, tmp_path / "cache" / "builtin-0123") is False


def test_conversion_writes_a_folder_load_checkpoint_reads(tiny_checkpoint, tmp_path):
    target = tmp_path / "builtin-0123"
    assert save_converted(tiny_checkpoint, target) is True
    again = load_checkpoint(str(target))
    assert set(again.state_dict) <= set(tiny_checkpoint.state_dict)
    for name in again.state_dict:
        assert again.state_dict[name].equal(tiny_checkpoint.state_dict[name])
    assert again.eos_token_ids == tiny_checkpoint.eos_token_ids
    assert not any(p.name.startswith(target.name + ".partial") for p in Path(tmp_path).iterdir())

