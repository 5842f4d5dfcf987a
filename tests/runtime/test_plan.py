"""`tandem plan` on every published config kept in docs/configs, against numbers derived by hand.

Each expected value is worked out in the comment beside it (vLLM's rule: block = 16 x
ceil(mamba_page / (16 x attention bytes per token)); padding = (block x per-token - mamba_page) / mamba_page).
Where vLLM's own tests pin a value (528, 400, 800, 80) the same value is expected here.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parents[2] / "docs" / "configs"

HYBRIDS = [
    # fixture, extra args, block, mamba page bytes, padding %
    # Bamba-9B bf16: attn 2*8*128*2 = 4096 B/token; conv 3*(8192+2*128) + ssm 128*64*128 = 1,073,920 elems x 2 B
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16"], 528, 2_147_840, 0.69),
    # TP=2: one group replicated to 2; conv 3*(8192+2*2*128)/2, ssm 64*64*128; attn 2*4*128*2 = 2048 B/token
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16", "--tp", "2"], 528, 1_074_688, 0.62),
    # SSM state in float32: 25,344*2 + 1,048,576*4 = 4,244,992 B -> 16*ceil(4,244,992/65,536) = 1040
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16", "--mamba-ssm-dtype", "float32"], 1040, 4_244_992, 0.35),
    # prefix caching: lcm(256, 16) * ceil(ceil(2,147,840/4096) / 256) = 256 * 3 = 768
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16", "--enable-prefix-caching"], 768, 2_147_840, 46.46),
    # granite-4.0-h-tiny: 48 heads x 64; conv 3*(3072+256), ssm 48*64*128 -> 806,400 B; attn 2*4*128*2 = 2048
    ("ibm-granite__granite-4.0-h-tiny", [], 400, 806_400, 1.59),
    # Nemotron-H-8B: 8 groups; conv 3*(8192+2*8*128) = 30,720 elems x 2 B + ssm 128*64*128 = 1,048,576 elems
    # x 4 B (vLLM keeps Nemotron-H's SSM state in float32) = 4,255,744 B -> 16*ceil(4,255,744/65,536) = 1040
    ("nvidia__Nemotron-H-8B-Base-8K", [], 1040, 4_255_744, 0.10),
    # The option overrides that default: 1,079,296 elems x 2 B -> 528, as for Bamba
    ("nvidia__Nemotron-H-8B-Base-8K", ["--mamba-ssm-dtype", "bfloat16"], 528, 2_158_592, 0.19),
    # Nemotron-H-56B: 256 heads x 64, 8 groups, d_state 256: conv 3*20,480 x 2 B + ssm 256*64*256 x 4 B
    ("nvidia__Nemotron-H-56B-Base-8K", [], 4128, 16_900_096, 0.05),
    ("nvidia__Nemotron-H-56B-Base-8K", ["--mamba-ssm-dtype", "bfloat16"], 2080, 8_511_488, 0.10),
    # Falcon-H1-0.5B: d_ssm 1536; conv 3*(1536+256) + ssm 24*64*128; attn 2*2*64*2 = 512 B/token
    ("tiiuae__Falcon-H1-0.5B-Instruct", [], 800, 403_968, 1.39),
    # Zamba2-1.2B (legacy keys): 64 heads x 64, d_state 128; attn 32 kv x (2*2048/32 = 128) -> 16,384 B/token
    ("Zyphra__Zamba2-1.2B", [], 80, 1_074_688, 21.96),
    # Zamba2-2.7B: 80 heads x 64, d_state 64 -> 343,424 elems; attn 2*32*160*2 = 20,480 B/token
    ("Zyphra__Zamba2-2.7B-Instruct-v2", ["--dtype", "bfloat16"], 48, 686_848, 43.12),
    # Jamba (Mamba-1): conv 3*8192 + ssm 8192*16 = 155,648 elems; attn 4096 B/token -> 16*ceil(311,296/65,536)
    ("ai21labs__Jamba-v0.1", [], 80, 311_296, 5.26),
    # Qwen3-Next: Gated DeltaNet conv 3*(2*16*128 + 32*128) + state 32*128*128; attn 2*2*256*2 = 2048
    ("Qwen__Qwen3-Next-80B-A3B-Thinking", [], 544, 1_097_728, 1.49),
    # LFM2: short conv (3-1) x 1536 = 3072 elems; attn 2*8*64*2 = 2048 -> the smallest block, 16
    ("LiquidAI__LFM2-700M", [], 16, 6_144, 433.33),
]

ATTENTION_FREE = [
    # Mamba-1 130m: conv 3*1536 + ssm 1536*16 = 29,184 elems x 4 B (float32)
    ("state-spaces__mamba-130m-hf", 116_736),
    # mamba_ssm-format Mamba-2 130m: 768*2/64 = 24 heads; conv 3*(1536+2*128) + ssm 24*64*128
    ("state-spaces__mamba2-130m", 807_936),
    # Mamba-2 2.7b: 80 heads; conv 3*(5120+256) + ssm 80*64*128 = 671,488 elems x 4 B
    ("state-spaces__mamba2-2.7b", 2_685_952),
    # FalconMamba-7B (reconstructed config): d_inner 2*4096; conv 3*8192 + ssm 8192*16 = 155,648 elems x 4 B
    ("tiiuae__falcon-mamba-7b", 622_592),
]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", "plan", *args], capture_output=True, text=True)


def plan_json(fixture: str, *args: str) -> dict:
    result = plan(str(FIXTURES / fixture), "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("fixture,args,block,mamba_page,padding", HYBRIDS)
def test_hybrid_block_size(fixture, args, block, mamba_page, padding):
    report = plan_json(fixture, *args)
    assert report["block_size"] == block
    assert report["mamba"]["page_size_bytes"] == mamba_page
    assert report["padding_pct"] == pytest.approx(padding, abs=0.005)
    assert report["page_size_bytes"] == block * report["attention"]["bytes_per_token"]


@pytest.mark.parametrize("fixture,page", ATTENTION_FREE)
def test_attention_free_has_no_block(fixture, page):
    report = plan_json(fixture)
    assert report["block_size"] is None and report["attention"] is None
    assert report["page_size_bytes"] == page
    assert report["num_state_groups"] == 1 and report["group_size"] == report["num_layers"]


def test_llama_is_plain_paged_attention():
    report = plan_json("meta-llama__Llama-3.2-1B")
    assert report["block_size"] == 16
    assert report["attention"]["bytes_per_token"] == 2 * 8 * 64 * 2
    assert report["mamba"] is None


def test_every_fixture_is_covered():
    covered = {f for f, *_ in HYBRIDS} | {f for f, _ in ATTENTION_FREE} | {"meta-llama__Llama-3.2-1B"}
    assert covered == {p.name for p in FIXTURES.iterdir() if p.is_dir()}


def test_memory_fit():
    # A page id spans 3 layer pages of 528*4096 B; a 4096-token sequence needs ceil(4096/528) = 8 KV
    # blocks in the one attention group and a state page in each of ceil(29/3) = 10 state groups.
    report = plan_json("ibm-ai-platform__Bamba-9B", "--dtype", "bfloat16", "--memory", "8GiB",
                       "--max-model-len", "4096")
    fit = report["fit"]
    assert fit["pages_per_sequence"] == 8 + 10
    assert fit["num_page_ids"] == 8 * 1024**3 // (3 * 528 * 4096)
    assert fit["max_num_sequences"] == fit["num_page_ids"] // 18 == 73


def test_layouts():
    nemotron = plan_json("nvidia__Nemotron-H-8B-Base-8K")
    assert nemotron["layer_counts"] == {"mamba2": 24, "mlp": 24, "attention": 4}
    zamba = plan_json("Zyphra__Zamba2-1.2B")
    assert zamba["layer_counts"] == {"mamba2": 32, "hybrid": 6}
    falcon = plan_json("tiiuae__Falcon-H1-0.5B-Instruct")
    assert falcon["layer_counts"] == {"parallel": 36}
    assert falcon["num_attention_groups"] == falcon["num_state_groups"] == 1


def test_text_output_explains_the_layout():
    result = plan(str(FIXTURES / "ibm-ai-platform__Bamba-9B"), "--dtype", "bfloat16")
    assert result.returncode == 0
    assert "block size     528 tokens" in result.stdout
    assert "padded by 0.69%" in result.stdout
    assert "(3, 8448) bfloat16 + (128, 64, 128) bfloat16" in result.stdout


@pytest.mark.parametrize("fixture,args,dtype,reason", [
    ("nvidia__Nemotron-H-8B-Base-8K", [], "float32", "the Nemotron-H default, as in vLLM"),
    ("nvidia__Nemotron-H-8B-Base-8K", ["--mamba-ssm-dtype", "bf16"], "bfloat16", "set by --mamba-ssm-dtype"),
    ("ibm-ai-platform__Bamba-9B", ["--dtype", "bfloat16"], "bfloat16", "the model dtype"),
])
def test_plan_says_which_state_dtype_it_used_and_why(fixture, args, dtype, reason):
    result = plan(str(FIXTURES / fixture), *args)
    assert result.returncode == 0, result.stderr
    assert f"state dtype    {dtype} ({reason}" in result.stdout


def config_asking_for(tmp_path, fixture: str, state_dtype: str) -> Path:
    raw = json.loads((FIXTURES / fixture / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "mamba_ssm_cache_dtype": state_dtype}))
    return tmp_path


def test_the_state_dtype_config_json_asks_for_is_honoured(tmp_path):
    # NVIDIA's newer Nemotron-H configs carry mamba_ssm_cache_dtype; on Bamba-9B float32 gives vLLM's 1040.
    directory = config_asking_for(tmp_path, "ibm-ai-platform__Bamba-9B", "float32")
    result = plan(str(directory), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    assert "block size     1040 tokens" in result.stdout
    assert "state dtype    float32 (asked for by mamba_ssm_cache_dtype in config.json)" in result.stdout
    # ... and the option overrides config.json.
    report = json.loads(plan(str(directory), "--dtype", "bfloat16", "--mamba-ssm-dtype", "bfloat16", "--json").stdout)
    assert report["block_size"] == 528 and report["mamba"]["dtypes"] == ["bfloat16", "bfloat16"]


def test_a_nemotron_config_asking_for_bfloat16_gets_it(tmp_path):
    directory = config_asking_for(tmp_path, "nvidia__Nemotron-H-8B-Base-8K", "bfloat16")
    assert json.loads(plan(str(directory), "--json").stdout)["block_size"] == 528


def test_an_aligned_larger_block_is_kept():
    assert plan_json("ibm-ai-platform__Bamba-9B", "--dtype", "bfloat16", "--block-size", "544")["block_size"] == 544
