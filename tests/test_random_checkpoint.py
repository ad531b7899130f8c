"""Shape-identical random checkpoints: their tokenizer covers the model's vocabulary and ExecuTorch's LLM
runner takes the folders they make."""
import json
import random


def test_shape_tokenizer_has_an_id_for_every_embedding_row_and_each_decodes_to_text():
    from bench.scale_models import CONFIGS
    from models.sources.random_checkpoint import shape_tokenizer

    config = CONFIGS["llama-3.2-1b"]
    tokenizer = shape_tokenizer(config)
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.bos_token_id == config["bos_token_id"] == 128000
    assert tokenizer.convert_ids_to_tokens(config["eos_token_id"]) == ["</s>", "<|eos_1|>", "<|eos_2|>"]
    assert tokenizer.eos_token_id == config["eos_token_id"][0]
    ids = random.Random(0).sample(range(config["vocab_size"]), 3000)
    texts = [tokenizer.decode([i]) for i in ids]
    assert all(text and text.isascii() for text in texts)
    prompt = "What is the capital of France?"
    encoded = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(encoded) == prompt and len(encoded) < len(prompt) * 2 / 3  # merged, not bytes
    assert tokenizer.unk_token_id not in encoded
    assert tokenizer.decode(tokenizer.encode("Étoile", add_special_tokens=False)).endswith("toile")


def test_the_tokenizer_a_family_class_reads_back_stays_within_the_vocabulary(tmp_path):
    """transformers reads a Qwen2.5 folder's tokenizer with its family's class, whose default pad token would be a
    new id past the embedding; the written tokenizer names its own, so the folder passes the vocabulary check."""
    from transformers import AutoConfig, AutoTokenizer

    from models.sources.random_checkpoint import shape_tokenizer
    from zoo.entries import load_entries

    config = next(e for e in load_entries().values() if e.repo_id == "Qwen/Qwen2.5-1.5B-Instruct").config
    shape_tokenizer(config).save_pretrained(tmp_path)
    AutoConfig.for_model(**config).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"  # the family's class, as a user's folder gets
    assert max(tokenizer.get_vocab().values()) == config["vocab_size"] - 1


def test_small_vocabulary_spells_lowercase_prompts_before_rarer_characters():
    from models.sources.random_checkpoint import shape_tokenizer

    tokenizer = shape_tokenizer({"vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2})
    assert len(tokenizer) == 64
    assert tokenizer.unk_token_id not in tokenizer.encode("the capital of paris", add_special_tokens=False)


def test_random_checkpoint_folder_runs_in_executorch_llm_runner(tmp_path):
    from models.sources.random_checkpoint import write_random_checkpoint
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 4096, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    folder = write_random_checkpoint(config, tmp_path / "random")
    summary = run(RunRequest(recipes=["xnnpack-fp32"], out_dir=tmp_path / "out", model=str(folder),
                             prompt="what is the capital of France?", max_new_tokens=6, max_seq_len=64))
    report = summary.recipes[0]
    assert report.runner_note is None
    by_engine = {g.engine: g for g in report.generations}
    runner = by_engine["executorch-llm-runner"]
    assert runner.new_tokens == 6 and runner.prompt_note is None
    assert runner.text == by_engine["executorch-runtime"].text


def test_a_big_checkpoint_is_written_in_shards_one_at_a_time_and_loads(tmp_path, monkeypatch):
    """Shards of at most SHARD_BYTES with the Hub's index (a shard is the most ever in memory), read back whole."""
    import models.sources.random_checkpoint as random_checkpoint
    from models.sources.checkpoint import load_checkpoint

    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 100_000)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    folder = random_checkpoint.write_random_checkpoint(config, tmp_path / "sharded")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    assert all(path.stat().st_size <= 100_000 + 64 * 512 * 2 + 4096 for path in shards)  # a bigger tensor goes alone
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {path.name for path in shards}
    assert len(load_checkpoint(str(folder)).state_dict) == len(index["weight_map"])
    assert random_checkpoint.write_random_checkpoint(config, tmp_path / "sharded") == folder  # written once
