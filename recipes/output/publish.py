"""Hand over one recipe's folder (model.pte, tokenizer.json, tokenizer_config.json, report.json, profile files)
with a generated model card: pushed to a Hugging Face Hub model repo, or as one zip. Used by the app's "Push to
Hub" button and downloads, and callable from scripts:

    from recipes.output.publish import push_to_hub, zip_recipe_folder
    url = push_to_hub("out/smollm2-8da4w", "me/smollm2-8da4w-xnnpack", token=os.environ["HF_TOKEN"])
    zip_path = zip_recipe_folder("out/smollm2-8da4w", "out/smollm2-8da4w.zip")
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from models.errors import UserFacingError
from recipes.files.atomic_write import write_atomically
from recipes.output.how_to_run import has_data_file, how_to_run
from recipes.output.profile_view import model_card_lines
from recipes.output.report import AdapterInfo, RecipeInfo, Report, load_report
from recipes.files.tokenizer_files import TOKENIZER_FILES

SHIPPED_FILES = ("model.pte", *TOKENIZER_FILES, "report.json")
DATA_FILE = "model.ptd"  # shipped too when the report says the weights are there


def model_card(report: Report, chat_template: str | None = None) -> str:
    """README.md for the repo: base model, recipe, how to run the files, delegation summary, fidelity when
    measured, versions."""
    model, recipe, delegation = report.model, report.recipe, report.delegation
    base = model.id or "unknown"
    lines = ["---", "library_name: executorch", "tags:", "- executorch", f"- {recipe.backend}", "- lowerbench"]
    if model.source in ("hub", "builtin") and "/" in base:
        lines += [f"base_model: {base}"]
    lines += ["---", "", f"# {base} · {recipe.name}", "",
              f"An ExecuTorch program (`model.pte`) of [{base}](https://huggingface.co/{base}) made by Lowerbench "
              f"with the `{recipe.name}` recipe: backend {recipe.backend}, quantization "
              f"`{recipe.quantization}`, max context {recipe.max_seq_len} tokens{_cache_words(recipe)}.", ""]
    if recipe.runs_on:
        lines += [f"It runs on {recipe.runs_on}.", ""]
    if model.revision:
        lines += [f"Base model revision: `{model.revision}`.", ""]
    if model.adapter:
        lines += [_adapter_sentence(model.adapter), ""]
    options = {k: v for k, v in recipe.options.items() if k != "device_runner"}  # in How to run
    if options:
        lines += ["Recipe options: " + ", ".join(f"`{k}={v}`" for k, v in sorted(options.items())) + ".", ""]
    quantization = report.quantization
    calibration = quantization.calibration if quantization else None
    if calibration:  # a calibrated algorithm's numbers depend on what it read
        lines += [f"Quantization algorithm `{quantization.algorithm}`, calibrated on {calibration.tokens} tokens "
                  f"of {calibration.text}.", ""]
    mixed = quantization.mixed_precision if quantization else None
    if mixed and mixed.units_8bit:
        from quant.mixed_precision import describe_units  # loads torch, which only this section's card needs

        lines += [f"Kept at 8 bits (8da8w) by the mixed-precision search, +{mixed.extra_bytes_per_token / 1e6:.2f} "
                  f"MB of weights per token: {describe_units(mixed.units_8bit)}.", ""]
    lines += how_to_run(report, chat_template)
    if delegation:
        lines += ["## Delegation", "",
                  f"{delegation.delegated_nodes} nodes delegated to {recipe.backend} in "
                  f"{delegation.delegated_subgraphs} subgraphs, {delegation.non_delegated_nodes} "
                  f"left to the portable kernels ({delegation.delegated_percent}% delegated).", ""]
    if report.fidelity:
        lines += ["## Fidelity against fp32", "", "```json", json.dumps(report.fidelity.to_dict(), indent=2), "```", ""]
    if report.generations:
        lines += ["## Sample generations", "", "| engine | prefill tok/s | decode tok/s | text |", "|---|---|---|---|"]
        for g in report.generations:
            text = g.text.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {g.engine} | {g.prefill_tokens_per_s} | {g.decode_tokens_per_s} | {text} |")
        lines.append("")
        if report.runner_note:
            lines += [f"ExecuTorch's LLM runner did not run this file here: {report.runner_note}.", ""]
    lines += model_card_lines(report)
    if report.pte:
        lines += [f"`model.pte`: {report.pte.bytes} bytes, sha256 `{report.pte.sha256}`.", ""]
        if has_data_file(report):
            lines += [f"`{DATA_FILE}`: {report.pte.ptd_bytes} bytes, sha256 `{report.pte.ptd_sha256}`.", ""]
    lines += ["## Versions", "", ", ".join(f"{k} {v}" for k, v in report.versions.items() if v), "",
              "`report.json` holds the full report (timings, per-op delegation table, generations)."]
    return "\n".join(lines) + "\n"


def _adapter_sentence(adapter: AdapterInfo) -> str:
    """Which LoRA adapter was merged into the weights before quantization, linked where it is on the Hub."""
    name = (f"[{adapter.id}](https://huggingface.co/{adapter.id})" if adapter.source == "hub"
            else f"`{adapter.id}` (a local folder)")
    revision = f" at revision `{adapter.revision}`" if adapter.revision else ""
    return (f"The LoRA adapter {name}{revision} (r {adapter.r}, alpha {adapter.alpha}, on "
            f"{', '.join(adapter.target_modules)}) was merged into the weights before quantization.")


def _cache_words(recipe: RecipeInfo) -> str:
    """", KV cache int8" (", a ring of the 2048 most recent tokens") for a recipe with the KV cache options."""
    cache = recipe.kv_cache
    if cache is None:
        return ""
    return f", KV cache {cache.dtype}" + (f" (a ring of the {cache.window} most recent tokens)" if cache.window else "")


def push_to_hub(recipe_dir: str | Path, repo_id: str, token: str | None, private: bool = False) -> str:
    """Creates `repo_id` if needed (a name without 'owner/' goes to the token's user) and uploads
    the folder's files (SHIPPED_FILES) and README.md in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:  # huggingface_hub 2.x talks through its httpx fork, 1.x through httpx itself
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError

    if not token:
        raise UserFacingError("pushing needs a Hugging Face token with write access; log in or paste a token.")
    recipe_dir = Path(recipe_dir)
    missing = [name for name in SHIPPED_FILES if not (recipe_dir / name).is_file()]
    if missing:
        raise UserFacingError(f"{recipe_dir} has no {', '.join(missing)}; run the recipe first.")
    report = load_report(recipe_dir / "report.json")
    shipped = shipped_files(recipe_dir, report)
    chat_template = folder_chat_template(recipe_dir)
    repo_id = repo_id.strip()
    if not repo_id:
        raise UserFacingError("give a repo name to push to, e.g. 'smollm2-xnnpack-8da4w'.")
    api = HfApi(token=token)
    try:
        if "/" not in repo_id:
            repo_id = f"{api.whoami()['name']}/{repo_id}"
        validate_repo_id(repo_id)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as staging:
            staging = Path(staging)
            for name in shipped:
                # a hard link where the folder allows: a weights file is gigabytes
                _link_or_copy(recipe_dir / name, staging / name)
            (staging / "README.md").write_text(model_card(report, chat_template))
            commit = api.upload_folder(
                repo_id=repo_id, folder_path=staging, repo_type="model",
                commit_message=f"Add {report.recipe.name} ExecuTorch program (Lowerbench)",
            )
    except HFValidationError:
        raise UserFacingError(f"{repo_id!r} is not a valid repo name; use letters, digits, '-', '_' and '.'.") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            raise UserFacingError("the Hub refused the token (invalid or expired); create one with write access at "
                                  "https://huggingface.co/settings/tokens.") from None
        if status == 403:
            raise UserFacingError(f"the token may not write to {repo_id}; use a token with write access to that "
                                  "namespace, or push to your own namespace.") from None
        raise UserFacingError(f"the Hub refused the push to {repo_id} (HTTP {status}); try again later.") from None
    except (TransportError, OSError) as err:
        raise UserFacingError(f"cannot reach the Hub to push {repo_id} ({type(err).__name__}); check the "
                              "network and try again.") from None
    return commit.commit_url if hasattr(commit, "commit_url") else str(commit)


def shipped_files(recipe_dir: Path, report: Report) -> tuple[str, ...]:
    """SHIPPED_FILES, and the .ptd when the program's weights are in it (a UserFacingError when it is missing)."""
    if not has_data_file(report):
        return SHIPPED_FILES
    if not (Path(recipe_dir) / DATA_FILE).is_file():
        raise UserFacingError(f"{recipe_dir} has no {DATA_FILE}, which holds this program's weights; run the recipe again.")
    return (*SHIPPED_FILES, DATA_FILE)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy(source, target)


def folder_chat_template(recipe_dir: Path) -> str | None:
    """The chat template of the folder's tokenizer_config.json, for the model card."""
    config = Path(recipe_dir) / "tokenizer_config.json"
    chat_template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(chat_template, list):  # several named templates: the runners' prompt is the default one
        chat_template = next((t.get("template") for t in chat_template if t.get("name") == "default"), None)
    return chat_template


# Files stored as they are in a zip: a program's weights hardly compress, and deflating gigabytes takes minutes.
STORED_SUFFIXES = (".pte", ".ptd", ".bin", ".etdump")


def zip_recipe_folder(recipe_dir: str | Path, zip_path: str | Path) -> Path:
    """Everything in the recipe's folder (its .pte, tokenizer files, report, profile files) and its model card as
    README.md, in one zip written atomically. Zips and half-written files in the folder are left out."""
    recipe_dir, zip_path = Path(recipe_dir), Path(zip_path)
    missing = [name for name in SHIPPED_FILES if not (recipe_dir / name).is_file()]
    if missing:
        raise UserFacingError(f"{recipe_dir} has no {', '.join(missing)}; run the recipe first.")
    files = sorted(f for f in recipe_dir.iterdir()
                   if f.is_file() and f.suffix != ".zip" and not f.name.startswith(".") and f.name != "README.md")
    report = load_report(recipe_dir / "report.json")
    shipped_files(recipe_dir, report)
    card = model_card(report, folder_chat_template(recipe_dir))

    def write(stream) -> None:
        with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
            for file in files:
                stored = file.suffix in STORED_SUFFIXES
                archive.write(file, file.name, compress_type=zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
            archive.writestr("README.md", card)

    write_atomically(zip_path, write)
    return zip_path
