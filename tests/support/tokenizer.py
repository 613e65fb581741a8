"""A served model's tokenizer and chat template, built for the tests (a small byte-level BPE, no
download): the prompt tokenizers' tests and the precise cache view's."""

from __future__ import annotations

import random
from pathlib import Path

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["route", "the", "cache", "  ", "\n", "Prefix", "42,", "blocks.", "héllo", "\t",
             "x=y", "don't", "(KV)", "--", "tokens"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def build_model_dir(out: Path) -> Path:
    """Train the tokenizer and save it with the chat template under ``out``."""
    import tokenizers
    import transformers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([words(3000, s) for s in range(3)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    return out
