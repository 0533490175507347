"""Builds a tiny Llama-architecture checkpoint offline: random weights and a byte-level BPE
tokenizer trained here on generated text. Runs in the e2e venv (torch, transformers, tokenizers).

Usage: python make_model.py OUT_DIR MAX_POSITION_EMBEDDINGS

Constraints from vLLM's CPU build (issue 15): the attention backend takes head_dim 64 (16 is
rejected), and `--max-model-len` may not exceed `max_position_embeddings`, so the caller passes
at least the rendered `--max-model-len`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

HIDDEN = 128
HEADS = 2  # head_dim = HIDDEN / HEADS = 64
LAYERS = 2
VOCAB = 512
SEED = 15


def corpus(n: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    words = ("gpu spot node drain stream token cache queue replica model serve route kernel "
             "socket metric alert scale prefill decode batch request latency budget").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(n)]


def build(out: str, max_pos: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   model_max_length=max_pos)
    fast.save_pretrained(tmp)

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS, max_position_embeddings=max_pos,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "gpuinfra-e2e.json"), "w") as f:
        json.dump({"max_position_embeddings": max_pos, "head_dim": HIDDEN // HEADS}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


if __name__ == "__main__":
    build(sys.argv[1], int(sys.argv[2]))
