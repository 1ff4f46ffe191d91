"""PyTorch eager anchor for bench/gpu.ts: 16 Llama-3.2-1B-shaped layers (random weights), one-token
decode through HF transformers' LlamaModel layers with a KV cache, bf16 and fp16, at positions 16
and 1024; CUDA events, median of 32 steps. Runs on the GPU machine beside the packed bench."""
import argparse, json, statistics, sys

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaModel
from transformers.cache_utils import DynamicCache

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="torch.json")
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--steps", type=int, default=32)
args = ap.parse_args()

cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192},
                  max_position_embeddings=131072, attn_implementation="sdpa")
rows = []
for dtype in (torch.bfloat16, torch.float16):
    model = LlamaModel(cfg).to("cuda", dtype=dtype).eval()
    for position in (16, 1024):
        with torch.no_grad():
            cache = DynamicCache()
            x = torch.randn(1, position, 2048, device="cuda", dtype=dtype) * 0.1
            model(inputs_embeds=x, past_key_values=cache, use_cache=True)
            step = torch.randn(1, 1, 2048, device="cuda", dtype=dtype) * 0.1
            times = []
            for i in range(args.steps + 4):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(inputs_embeds=step, past_key_values=cache, use_cache=True)
                end.record()
                torch.cuda.synchronize()
                if i >= 4:
                    times.append(start.elapsed_time(end))
        rows.append({"dtype": str(dtype).split(".")[-1], "position": position, "msPerToken": statistics.median(times)})
        print(f"torch eager {rows[-1]['dtype']} position {position}: {rows[-1]['msPerToken']:.2f} ms/token", flush=True)
    del model
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, open(args.out, "w"), indent=2)
