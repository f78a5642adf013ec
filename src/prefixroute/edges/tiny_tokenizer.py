"""A byte-level BPE tokenizer trained here, in the layout of a Hugging Face tokenizer directory.

For machines without a model hub (tests, air-gapped trials of ``diff``, ``lint`` and ``hash``):
``prefixroute tokenizer --tiny DIR`` and the test suites write the same tokenizer, a
2,000-token vocabulary learned from the first Python standard-library sources, the special
tokens of ``scripts/make_tiny_model.py``, a post-processor that puts ``<|bos|>`` in front of
every encoded text (as vLLM's ``/v1/completions`` tokenization does), and the same
one-line-per-message chat template. Only the ``tokenizers`` library is needed (no torch, no
transformers). ``tokenizer.json`` and ``tokenizer_config.json`` are all that is written, which
is all :func:`prefixroute.edges.tokenization.load_tokenizer` reads.

Token counts from it are not a real model's: a real deployment points ``--tokenizer`` at the
directory of the model it serves.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]

# The template of scripts/make_tiny_model.py: one line per message, then the assistant tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The same, with the tool list rendered first the way real templates (Llama 3, Qwen) do:
# ``tojson`` keeps the caller's key order, so tool order and key order reach the tokens.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}" + CHAT_TEMPLATE
)

VOCAB_SIZE = 2000
TRAINING_FILES = 120  # the first sources of the stdlib, sorted: enough text for 2,000 merges


def _training_files() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(stdlib, "*.py")))[:TRAINING_FILES]


def make_tiny_tokenizer(directory: str | os.PathLike, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Train the tokenizer and write ``tokenizer.json`` and ``tokenizer_config.json`` into
    ``directory`` (created if missing). Deterministic for one Python installation."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train(_training_files(), trainer)
    bos = bpe.token_to_id("<|bos|>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    bpe.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, chat_template)
    return out


def write_tokenizer_config(directory: str | os.PathLike, chat_template: str) -> None:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 1_000_000,
        "chat_template": chat_template,
    }
    Path(directory, "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def copy_with_template(source: str | os.PathLike, directory: str | os.PathLike,
                       chat_template: str) -> Path:
    """Copy a tokenizer directory made by :func:`make_tiny_tokenizer`, with another chat
    template (training once per session is the slow part)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(source, "tokenizer.json"), out / "tokenizer.json")
    write_tokenizer_config(out, chat_template)
    return out
