"""``dctms run --prompt … --image …`` applies the folder's chat template as mlx-vlm's generate
does (issue 35: a folder saved by transformers 5, with ``chat_template.jinja``, gave mlx-vlm 58
prompt tokens and dctms 14). The prompt ids equal those mlx-vlm's own ``apply_chat_template`` and
``prepare_inputs`` make, on a tiny gemma3 model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# A Gemma-style template, written as transformers 5 saves one: chat_template.jinja beside the
# tokenizer. Images are the content parts of type "image".
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PROMPT = "what is in the picture"


@pytest.fixture(scope="module")
def chat_vlm(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder with a chat template, its plan, an image)."""
    from PIL import Image

    from dctms.cli.main import main
    from dctms.toolkit.vision.tiny import write_tiny_vlm

    root = tmp_path_factory.mktemp("chat-vlm")
    folder = write_tiny_vlm(root / "model", "gemma3")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    image = root / "image.png"
    Image.new("RGB", (32, 32), (10, 120, 220)).save(image)
    plan = root / "p.plan"
    argv = ["compile", str(folder), "-N", "160", "-M", "2", "--prefill-chunk", "32", "--images",
            "1", "--image-size", "32x32", "--pack-seconds", "0", "-q", "-o", str(plan)]  # fmt: skip
    assert main(argv) == 0
    return folder, plan, image


def _mlx_vlm_prompt_ids(folder: Path, image: Path) -> list[int]:
    """The ids mlx-vlm's generate feeds: its apply_chat_template, then its prepare_inputs."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_model, load_processor, prepare_inputs, should_add_special_tokens
    from PIL import Image

    model = load_model(folder)  # first: it registers the family's processor with transformers
    processor = load_processor(folder, add_detokenizer=False)
    text = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    inputs = prepare_inputs(
        processor,
        images=[Image.open(image).convert("RGB")],
        prompts=[text],
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
    )
    return inputs["input_ids"][0].tolist()


def test_the_prompt_ids_equal_mlx_vlms_with_the_chat_template(chat_vlm, tmp_path) -> None:
    folder, plan, image = chat_vlm
    runs = {}
    for name, extra in (("chat", []), ("raw", ["--ignore-chat-template"])):
        report = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "dctms.cli.main", "run", str(plan), "--model", str(folder),
             "--prompt", PROMPT, "--image", str(image), "--report", str(report), *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        runs[name] = json.loads(report.read_text())["prompt_tokens"]
    assert runs["chat"] == _mlx_vlm_prompt_ids(folder, image)
    assert len(runs["chat"]) > len(runs["raw"])  # the template's turns are really there
