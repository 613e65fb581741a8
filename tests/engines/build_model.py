"""Build the engine tests' model locally: a byte-level BPE tokenizer trained on this repository's
text, with BOS/EOS and a chat template, and a random-init Llama small enough for a 2-core CPU.

Runs in the engine venv (tests/engines/setup.sh), which has vLLM's torch, transformers and
tokenizers; nothing is downloaded. The outputs are random text: the tests ask for a fixed number
of tokens with ``ignore_eos``. Usage: ``python build_model.py OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 6000
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
# Role markers and the generation prompt, as Llama-style templates render them; BOS first, so a
# router must apply the template (not just the tokenizer) to hash what the engine caches.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    files = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("gorgo/**/*.py"), ROOT / "README.md"])
    return [p.read_text(errors="replace") for p in files if p.is_file()]


def build(out: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", add_bos_token=True)
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=65536,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=True, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
