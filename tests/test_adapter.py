"""A PEFT LoRA adapter merged into the checkpoint before the module is built (models/sources/adapter.py,
adapter_merge.py): the merged module computes what PEFT's own merge_and_unload() computes, a mismatched adapter is
refused before any weight is read, a Hub adapter comes down alone, and the report and model card name it."""
import json
import shutil

import pytest
import torch

from models.errors import UserFacingError
from models.llama import ExportOptions, build_exportable
from models.sources.checkpoint import SafetensorsWeights, load_checkpoint
from recipes.output.publish import model_card
from recipes.output.report import AdapterInfo, ModelInfo, Report, load_report
from tests.conftest import GOOD_TOKEN, OTHER_TOKEN, run_main
from tests.test_report import DATA

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "the capital of France is Paris ."


def save_peft_adapter(base_dir, folder, **lora_options):
    """A LoRA adapter made by PEFT itself on the model in base_dir, its lora_B randomized (PEFT starts it at
    zero), saved into folder; returns PEFT's own merge_and_unload() of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(2)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(lora_dropout=0.0, **lora_options))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_dir, tmp_path_factory):
    """A plain LoRA (r 4, alpha 8) on every linear of the tiny Llama's decoder layers."""
    folder = tmp_path_factory.mktemp("lora")
    save_peft_adapter(tiny_llama_dir, folder, r=4, lora_alpha=8, target_modules=ALL_LINEARS)
    return folder


def edited_adapter(lora_dir, tmp_path, **config):
    """A copy of lora_dir whose adapter_config.json has these keys changed."""
    folder = tmp_path / "edited"
    shutil.copytree(lora_dir, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def eager_logits(checkpoint, tokens) -> torch.Tensor:
    module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(64, attention="sdpa"))
    with torch.no_grad():
        return module(tokens, torch.tensor([0]))


@pytest.mark.parametrize("lora_options", [
    dict(r=4, lora_alpha=8, target_modules=ALL_LINEARS),
    dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
         rank_pattern={"model.layers.1.self_attn.q_proj": 2}, alpha_pattern={"down_proj": 3}),
], ids=["plain", "rslora-with-patterns"])
def test_the_merged_module_computes_what_pefts_own_merge_computes(tiny_llama_dir, tiny_checkpoint, tmp_path,
                                                                   lora_options):
    merged_by_peft = save_peft_adapter(tiny_llama_dir, tmp_path / "lora", **lora_options)
    checkpoint = load_checkpoint(str(tiny_llama_dir), adapter=str(tmp_path / "lora"))
    tokens = torch.tensor([checkpoint.tokenizer(PROMPT)["input_ids"]])

    ours = eager_logits(checkpoint, tokens)
    peft_weights = {name: tensor.detach() for name, tensor in merged_by_peft.state_dict().items()}
    peft_module = build_exportable(checkpoint.config, peft_weights, ExportOptions(64, attention="sdpa"))
    with torch.no_grad():
        theirs = peft_module(tokens, torch.tensor([0]))
        transformers_logits = merged_by_peft(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - transformers_logits).abs().max().item() < 1e-4  # the module's own tolerance (test_spine.py)
    assert (ours - eager_logits(tiny_checkpoint, tokens)).abs().max().item() > 1e-2  # the adapter did change them

    described = checkpoint.describe()["adapter"]
    assert described["source"] == "local-folder" and described["id"] == "lora" and described["revision"] is None
    assert described["r"] == 4 and described["alpha"] == lora_options["lora_alpha"]
    assert described["target_modules"] == sorted(lora_options["target_modules"])
    assert described["linears"] == 2 * len(lora_options["target_modules"])
    assert described.get("rslora") == lora_options.get("use_rslora")
    assert described.get("rank_pattern") == lora_options.get("rank_pattern")
    assert ModelInfo.from_dict(checkpoint.describe(), strict=True).adapter.r == 4  # as run() reads it


def test_the_merge_keeps_safetensors_lazy_and_a_checkpoint_without_adapter_unchanged(tiny_llama_dir, lora_dir,
                                                                                    tiny_checkpoint):
    checkpoint = load_checkpoint(str(tiny_llama_dir), adapter=str(lora_dir))
    assert isinstance(checkpoint.state_dict.base, SafetensorsWeights)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint.state_dict[name] is not checkpoint.state_dict[name]  # merged as read, never kept
    assert checkpoint.parameters == tiny_checkpoint.parameters and checkpoint.dtype == tiny_checkpoint.dtype
    assert torch.equal(checkpoint.state_dict["model.norm.weight"], tiny_checkpoint.state_dict["model.norm.weight"])

    assert isinstance(tiny_checkpoint.state_dict, SafetensorsWeights) and tiny_checkpoint.adapter is None
    assert list(tiny_checkpoint.describe()) == ["source", "id", "revision", "architecture", "family", "parameters"]


def refused(tiny_llama_dir, adapter, **kwargs) -> str:
    with pytest.raises(UserFacingError) as info:
        load_checkpoint(str(tiny_llama_dir), adapter=str(adapter), **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("config, fragments", [
    ({"peft_type": "IA3"}, ["IA3 adapter", "LoRA adapters only"]),
    ({"bias": "all"}, ["bias 'all'", "bias 'none'"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save", "merge_and_unload"]),
    ({"use_dora": True}, ["DoRA", "merged model"]),
    ({"r": 8}, ["rank is 8", "disagree"]),
    ({"target_modules": ["query_key_value", "dense"]}, ["'dense'", "another architecture"]),
    ({"rank_pattern": {"q_proj[": 2}}, ["not a regular expression"]),
], ids=["not-lora", "bias", "modules-to-save", "dora", "rank-disagrees", "missing-target", "bad-pattern"])
def test_an_adapter_it_cannot_merge_is_refused_with_what_to_do(tiny_llama_dir, lora_dir, tmp_path, config,
                                                                fragments):
    message = refused(tiny_llama_dir, edited_adapter(lora_dir, tmp_path, **config))
    for fragment in fragments:
        assert fragment in message, message


def test_an_adapter_of_another_shape_is_refused_from_the_config(tiny_llama_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    get_peft_model(other, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "other")
    message = refused(tiny_llama_dir, tmp_path / "other")
    assert "maps 32 inputs to 32 outputs" in message and "64 inputs and 64 outputs" in message
    assert "trained on another model" in message


def test_an_adapter_of_layers_the_model_lacks_or_of_the_embedding_is_refused(tiny_llama_dir, lora_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for old, new, fragment in [(".layers.1.", ".layers.5.", "has 2 decoder layers"),
                               (".layers.1.self_attn.q_proj.", ".embed_tokens.", "not a linear of a decoder layer")]:
        folder = edited_adapter(lora_dir, tmp_path / new.strip("."))
        tensors = load_file(folder / "adapter_model.safetensors")
        save_file({name.replace(old, new): tensor for name, tensor in tensors.items()},
                  folder / "adapter_model.safetensors")
        assert fragment in refused(tiny_llama_dir, folder)


def test_missing_or_pickled_adapter_files_are_refused(tiny_llama_dir, lora_dir, tmp_path):
    from safetensors.torch import load_file

    assert "not a folder" in refused(tiny_llama_dir, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in refused(tiny_llama_dir, tmp_path / "empty")
    pickled = edited_adapter(lora_dir, tmp_path)
    torch.save(load_file(pickled / "adapter_model.safetensors"), pickled / "adapter_model.bin")
    (pickled / "adapter_model.safetensors").unlink()
    assert "--allow-pickle" in refused(tiny_llama_dir, pickled)
    assert load_checkpoint(str(tiny_llama_dir), adapter=str(pickled), allow_pickle=True).adapter.r == 4
    (pickled / "adapter_model.bin").unlink()
    assert "no adapter_model.safetensors" in refused(tiny_llama_dir, pickled)
    assert "local folder" in refused(tiny_llama_dir, lora_dir, adapter_revision="v1")


def test_a_hub_adapter_comes_down_alone_and_one_of_another_base_is_refused_before_any_weight(hub, lora_dir,
                                                                                            tmp_path):
    adapter = edited_adapter(lora_dir, tmp_path, base_model_name_or_path="org/tiny-llama")
    (adapter / "training_args.bin").write_bytes(b"not needed")
    hub.add_repo("org/tiny-lora", adapter, branches=("main", "v1"))
    hub.add_repo("org/gated-lora", adapter, gated_for=[GOOD_TOKEN])
    hub.add_repo("org/other-lora", edited_adapter(lora_dir, tmp_path / "other", base_model_name_or_path="org/other"))

    checkpoint = load_checkpoint("org/tiny-llama", adapter="org/tiny-lora", adapter_revision="v1")
    assert hub.requested_files("org/tiny-lora") == {"adapter_config.json", "adapter_model.safetensors"}
    described = checkpoint.describe()["adapter"]
    assert (described["source"], described["id"], described["revision"]) == ("hub", "org/tiny-lora", "v1")

    with pytest.raises(UserFacingError) as info:
        load_checkpoint("org/gated-llama", adapter="org/gated-lora", token=OTHER_TOKEN)
    assert "gated" in str(info.value) and OTHER_TOKEN not in str(info.value)
    with pytest.raises(UserFacingError) as info:
        load_checkpoint("org/gated-llama", adapter="org/other-lora", token=GOOD_TOKEN)
    assert "trained on org/other" in str(info.value) and "--model org/other" in str(info.value)
    assert not hub.requested_files("org/gated-llama")  # refused before the model's config was asked for


def test_the_report_and_the_model_card_name_the_adapter(tmp_path):
    written = load_report(DATA / "report_xnnpack_fp32.json")
    adapter = AdapterInfo(source="hub", id="org/tiny-lora", revision="v1", r=4, alpha=8,
                          target_modules=["q_proj", "v_proj"], linears=4, rslora=True)
    report = Report.from_dict({**written.to_dict(), "model": {**written.model.to_dict(),
                                                               "adapter": adapter.to_dict()}}, strict=True)
    assert report.model.adapter == adapter
    assert Report.from_dict(json.loads(report.to_json()), strict=True) == report
    assert "rank_pattern" not in report.to_dict()["model"]["adapter"]
    assert list(ModelInfo.from_dict(written.model.to_dict()).to_dict()) == list(written.model.to_dict())

    card = model_card(report)
    assert "[org/tiny-lora](https://huggingface.co/org/tiny-lora) at revision `v1`" in card
    assert "merged into the weights before quantization" in card
    assert "LoRA" not in model_card(written)


def test_the_command_line_refuses_a_bad_adapter_before_any_work(tiny_llama_dir, lora_dir, tmp_path):
    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out),
                      "--adapter", str(edited_adapter(lora_dir, tmp_path, peft_type="PREFIX_TUNING")))
    assert result.returncode == 2 and "LoRA adapters only" in result.stderr.strip().splitlines()[-1]
    assert not list(out.rglob("*.pte"))
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out),
                      "--adapter-revision", "v1")
    assert result.returncode == 2 and "without an adapter" in result.stderr


def test_the_apps_adapter_box_takes_a_hub_id_only_where_local_paths_are_disabled(lora_dir, monkeypatch):
    from app import choose_adapter

    assert choose_adapter("  ") is None and choose_adapter(str(lora_dir)) == str(lora_dir)
    monkeypatch.setenv("LOWERBENCH_ALLOW_LOCAL_PATHS", "0")
    assert choose_adapter(" org/tiny-lora ") == "org/tiny-lora"
    with pytest.raises(UserFacingError, match="not a valid Hugging Face repo id"):
        choose_adapter(str(lora_dir))
