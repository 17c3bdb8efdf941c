#!/usr/bin/env bash
# make_corpus.sh — (re)generates the seed corpora of the fuzz targets in
# tests/fuzz/corpus/{config,safetensors,shards}: valid files written by
# centrifuge itself (gen-data, a one-step `train --out` checkpoint of a very
# small model, `score`), hand-made valid edge cases, and one broken file per
# entry of the bad-input catalogue (DESIGN §5). Every file stays < 64 KiB.
# Usage: tests/fuzz/make_corpus.sh [./centrifuge]
set -euo pipefail
export LC_ALL=C
BIN=$(realpath "${1:-./centrifuge}")
HERE=$(cd "$(dirname "$0")" && pwd)
OUT="$HERE/corpus"
T=$(mktemp -d /tmp/cf_corpus_XXXXXX)
trap 'rm -rf "$T"' EXIT
rm -rf "$OUT/config" "$OUT/safetensors" "$OUT/shards"
mkdir -p "$OUT/config" "$OUT/safetensors" "$OUT/shards"
C="$OUT/config" S="$OUT/safetensors" D="$OUT/shards"

# ------------------------------------------------------------ byte helpers
bytes() { local f=""; for b in "$@"; do f+=$(printf '\\x%02x' $((b & 255))); done; printf "$f"; }
le32() { local n=$1; bytes $n $((n >> 8)) $((n >> 16)) $((n >> 24)); }
le64() { local n=$1; bytes $n $((n >> 8)) $((n >> 16)) $((n >> 24)) $((n >> 32)) $((n >> 40)) $((n >> 48)) $((n >> 56)); }
zeros() { head -c "$1" /dev/zero; }
# shard_header MAGIC VERSION COUNT [HASH_LO HASH_HI]: 256 little-endian int32
shard_header() { le32 "$1"; le32 "$2"; le32 "$3"; le32 "${4:-0}"; le32 "${5:-0}"; zeros $((251 * 4)); }
# st JSON DATA_BYTES [LEN_OVERRIDE]: a safetensors file with a zero-filled data section
st() { le64 "${3:-${#1}}"; printf '%s' "$1"; zeros "$2"; }
# poke FILE OFFSET BYTE...: overwrite bytes in place
poke() { local f=$1 off=$2; shift 2; bytes "$@" | dd of="$f" bs=1 seek="$off" conv=notrunc status=none; }

# ------------------------------------------------------- files from the CLI
"$BIN" gen-data --source clean --tokens 400 --seed 11 --out "$D/tokens_clean.bin" >/dev/null
"$BIN" gen-data --source noisy --tokens 300 --seed 12 --out "$D/tokens_noisy.bin" >/dev/null
"$BIN" gen-data --source clean --tokens 20000 --seed 13 --out "$T/train.bin" >/dev/null
# a very small llama (vocab 320 so the byte corpus fits; ~3k parameters)
cat >"$T/small.json" <<'EOF'
{"model_type": "llama", "vocab_size": 320, "hidden_size": 8, "intermediate_size": 16,
 "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
 "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
 "tie_word_embeddings": true, "bos_token_id": 256, "eos_token_id": 257}
EOF
"$BIN" train --config "$T/small.json" --data "$T/train.bin" --steps 1 --batch 2 --seq 16 --out "$T/small" --quiet
M="$T/small/step_00000001"
cp "$M/model.safetensors" "$S/small_model.safetensors"
cp "$M/config.json" "$C/small_saved.json"
cp "$T/small.json" "$C/small_handwritten.json"
"$BIN" score --model "$M" --data "$D/tokens_clean.bin" --out "$D/ref_clean.bin" --seq 16 >/dev/null
"$BIN" train --config tiny --data "$T/train.bin" --steps 1 --batch 2 --seq 16 --out "$T/tiny" --quiet
cp "$T/tiny/step_00000001/config.json" "$C/tiny_saved.json"

# ------------------------------------------------------------ config.json
cat >"$C/llama3_rope_scaling.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "head_dim": 8, "max_position_embeddings": 1024, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
 "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 256, "rope_type": "llama3"},
 "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false, "hidden_act": "silu",
 "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16"}
EOF
cat >"$C/llama3_legacy_type.json" <<'EOF'
{"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
 "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"type": "llama3", "factor": 8,
 "low_freq_factor": 1, "high_freq_factor": 4}, "original_max_position_embeddings": 128,
 "attention_bias": true}
EOF
cat >"$C/qwen2.json" <<'EOF'
{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 32768, "max_window_layers": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "sliding_window": null, "use_sliding_window": false, "tie_word_embeddings": true,
 "bos_token_id": 151643, "eos_token_id": 151643, "rope_scaling": null}
EOF
cat >"$C/qwen3_rope_parameters.json" <<'EOF'
{"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-06,
 "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "layer_types": ["full_attention",
 "full_attention"], "attention_bias": false, "use_sliding_window": false, "bos_token_id": null}
EOF
cat >"$C/mistral_sliding_window.json" <<'EOF'
{"model_type": "mistral", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
 "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": 4096,
 "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
EOF
# broken
printf '{"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768}' >"$C/bad_model_type.json"
printf '{"model_type": "llama", "vocab_size": 10, "vocab_size": 20, "hidden_size": 8}' >"$C/bad_duplicate_key.json"
printf '{"model_type": "llama", "vocab_size": "320", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}' >"$C/bad_string_for_int.json"
head -c 150 "$C/tiny_saved.json" >"$C/bad_truncated.json"
{ cat "$C/small_handwritten.json"; printf 'garbage'; } >"$C/bad_trailing_data.json"
printf '[1, 2, 3]' >"$C/bad_not_an_object.json"
: >"$C/bad_empty.json"
printf '{"model_type": "llama", "vocab_size": 1e400, "hidden_size": 8}' >"$C/bad_huge_number.json"
printf '{"model_type": "llama", "vocab_size": -5, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}' >"$C/bad_negative_vocab.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 12, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 3}' >"$C/bad_gqa_not_dividing.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 12, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4}}' >"$C/bad_rope_type.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "rope_parameters": {"full_attention": {"rope_theta": 1e4}}}' >"$C/bad_rope_per_layer.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "quantization_config": {"bits": 4}}' >"$C/bad_quantized.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "mlp_bias": true}' >"$C/bad_mlp_bias.json"
printf '{"model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "use_sliding_window": true}' >"$C/bad_qwen2_sliding.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 15, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 5}' >"$C/bad_odd_head_dim.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "bos_token_id": 64}' >"$C/bad_bos_beyond_vocab.json"
printf '{"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, "eos_token_id": [2, 63, 64]}' >"$C/bad_eos_list_beyond_vocab.json"

# ------------------------------------------------------------ safetensors
A='{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}'
st "$A" 22 >"$S/two_tensors.safetensors"
st '{"h":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},"s":{"dtype":"F32","shape":[],"data_offsets":[8,12]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[12,12]}}' 12 >"$S/f16_scalar_empty.safetensors"
st '{"x":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' 16 >"$S/gaps_and_trailing.safetensors"
st '{}' 0 >"$S/no_tensors.safetensors"
# broken
head -c 9000 "$S/small_model.safetensors" >"$S/bad_truncated.safetensors"
st "$A" 22 99999 >"$S/bad_header_beyond_file.safetensors"
st '{"a":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}}' 16 >"$S/bad_dtype.safetensors"
st '{"a":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}}' 16 >"$S/bad_shape_size.safetensors"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12 >"$S/bad_overlap.safetensors"
st '{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}' 8 >"$S/bad_begin_after_end.safetensors"
st '{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' 8 >"$S/bad_offsets_beyond_data.safetensors"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}' 8 >"$S/bad_duplicate_name.safetensors"
st '{"__metadata__":{"format":1},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' 4 >"$S/bad_metadata_value.safetensors"
st '{"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}}' 4 >"$S/bad_too_many_dims.safetensors"
st '{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}' 4 >"$S/bad_negative_dim.safetensors"
st '{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}' 4 >"$S/bad_shape_overflow.safetensors"
st '{"a\u0001b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' 4 >"$S/bad_control_char_name.safetensors"
st '[1,2]' 0 >"$S/bad_header_not_object.safetensors"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x' 4 >"$S/bad_header_trailing.safetensors"
le64 0 >"$S/bad_header_length_zero.safetensors"
printf 'abc' >"$S/bad_too_short.safetensors"
# index files (the fuzz target also opens inputs starting with '{' as a
# model.safetensors.index.json beside two valid shards: model.a, model.b in
# model-00001-of-00002.safetensors and model.c in model-00002-of-00002)
I1='"model-00001-of-00002.safetensors"' I2='"model-00002-of-00002.safetensors"'
printf '{"metadata":{"total_size":48},"weight_map":{"model.a":%s,"model.b":%s,"model.c":%s}}' "$I1" "$I1" "$I2" >"$S/index_valid.json"
printf '{"weight_map":{"model.a":%s}}' "$I1" >"$S/index_bad_tensor_not_in_map.json"
printf '{"weight_map":{"model.a":%s,"model.b":%s,"model.c":%s}}' "$I2" "$I1" "$I2" >"$S/index_bad_wrong_file.json"
printf '{"weight_map":{"model.a":"../model-00001-of-00002.safetensors"}}' >"$S/index_bad_path_escape.json"
printf '{"weight_map":{"model.a":%s,"model.x":"model-00003-of-00003.safetensors"}}' "$I1" >"$S/index_bad_missing_shard.json"
printf '{"metadata":{"centrifuge_save_id":"0123456789abcdef"},"weight_map":{"model.a":%s,"model.b":%s,"model.c":%s}}' "$I1" "$I1" "$I2" >"$S/index_bad_mixed_saves.json"
printf '{"weight_map":[]}' >"$S/index_bad_weight_map.json"

# ---------------------------------------------------------- token shards
{ shard_header 20240520 2 6; for id in 256 72 105 33 257 0; do le32 $id; done; } >"$D/tokens_u32.bin"
shard_header 20240520 1 0 >"$D/tokens_empty.bin"
cp "$D/tokens_clean.bin" "$D/bad_tokens_id_beyond_vocab.bin"; poke "$D/bad_tokens_id_beyond_vocab.bin" 1100 255 255
cp "$D/tokens_clean.bin" "$D/bad_tokens_magic.bin"; poke "$D/bad_tokens_magic.bin" 0 120 120
cp "$D/tokens_clean.bin" "$D/bad_tokens_version.bin"; poke "$D/bad_tokens_version.bin" 4 9
head -c 1500 "$D/tokens_clean.bin" >"$D/bad_tokens_truncated.bin"
{ cat "$D/tokens_clean.bin"; bytes 1; } >"$D/bad_tokens_misaligned.bin"
{ shard_header 20240520 1 -7; } >"$D/bad_tokens_negative_count.bin"
head -c 700 "$D/tokens_clean.bin" >"$D/bad_tokens_short_header.bin"
# ---------------------------------------------------- reference-loss shards
cp "$D/ref_clean.bin" "$D/bad_ref_nan.bin"; poke "$D/bad_ref_nan.bin" $((1024 + 4 * 10)) 0 0 192 127
cp "$D/ref_clean.bin" "$D/bad_ref_inf.bin"; poke "$D/bad_ref_inf.bin" $((1024 + 4 * 11)) 0 0 128 127
cp "$D/ref_clean.bin" "$D/bad_ref_negative.bin"; poke "$D/bad_ref_negative.bin" $((1024 + 4 * 12)) 0 0 128 191
cp "$D/ref_clean.bin" "$D/bad_ref_first_nonzero.bin"; poke "$D/bad_ref_first_nonzero.bin" 1024 0 0 128 63
cp "$D/ref_clean.bin" "$D/bad_ref_version.bin"; poke "$D/bad_ref_version.bin" 4 2
head -c 2000 "$D/ref_clean.bin" >"$D/bad_ref_truncated.bin"

# --------------------------------------------- hand-made regression inputs
# Hostile edge cases kept in tests/fuzz/regressions/ (replayed through all
# three readers by tests/test_fuzz_regressions.c) beside any input a fuzzer
# ever found; only the files named here are rewritten.
R="$HERE/regressions"
mkdir -p "$R"
{ bytes 255 255 255 255 255 255 255 255; printf '{}'; } >"$R/st_header_length_2pow64_minus_1"
{ bytes 0 0 0 0 0 0 0 128; printf '{}'; } >"$R/st_header_length_2pow63"
st '{"a":{"dtype":"F32","shape":[],"data_offsets":[9007199254740992,9007199254740992]}}' 4 >"$R/st_offsets_2pow53"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[9007199254740993,9007199254740997]}}' 4 >"$R/st_offsets_above_2pow53"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[1.5,5]}}' 8 >"$R/st_offsets_fraction"
st '{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}' 0 >"$R/st_shape_product_wraps_to_zero"
st '{"a":{"dtype":"F32","shape":[1073741824,4],"data_offsets":[0,0]}}' 0 >"$R/st_bytes_wrap_32bit"
st '{"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}}' 0 >"$R/st_bytes_wrap_64bit"
st '{"z":{"dtype":"F32","shape":[0,9007199254740992],"data_offsets":[0,0]}}' 0 >"$R/st_empty_with_huge_dim"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{},"__metadata__":{}}' 4 >"$R/st_two_metadata"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[0],"data_offsets":[2,2]}}' 4 >"$R/st_empty_tensor_inside_another"
name=$(head -c 300 /dev/zero | tr '\0' 'n')
st "{\"$name\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}" 4 >"$R/st_name_300_bytes"
st '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' 4 2 >"$R/st_header_cut_mid_json"
{ printf '{"weight_map":{'; for i in $(seq 1 1000); do printf '"t%d":"model-00001-of-00002.safetensors",' $i; done; printf '"model.a":"model-00001-of-00002.safetensors"}}'; } >"$R/index_1000_missing_tensors.json"
printf '{"weight_map":{"model.a":"model-00001-of-00002.safetensors\u0000x","model.b":"model-00001-of-00002.safetensors"}}' >"$R/index_nul_in_file_name.json"
printf '{"weight_map":{"model.a":"."}}' >"$R/index_dot_file_name.json"
printf '{"weight_map":{"model.a":"model.safetensors.index.json"}}' >"$R/index_names_itself.json"
{ printf '{"model_type":"llama","x":'; for i in $(seq 1 5000); do printf '['; done; for i in $(seq 1 5000); do printf ']'; done; printf '}'; } >"$R/config_nesting_5000"
printf '{"model_type":"llama","vocab_size":2147483648,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2}' >"$R/config_int_above_int_max"
printf '{"model_type":"llama","vocab_size":64,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"rope_theta":1e308,"rms_norm_eps":-0.0}' >"$R/config_float_extremes"
printf '{"model_type":"llama","vocab_size":64,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":0}' >"$R/config_zero_heads"
printf '{"model_type":"llama","vocab_size":64,"hidden_size":65536,"intermediate_size":262144,"num_hidden_layers":1,"num_attention_heads":1024,"head_dim":1024}' >"$R/config_tensor_over_2pow31"
{ printf '{"model_type":"llama",'; bytes 0; printf '"vocab_size":64}'; } >"$R/config_nul_byte"
printf '{"model_type":"llama\u0000x","vocab_size":64}' >"$R/config_escaped_nul_in_value"
printf '{"model_type":"llama","eos_token_id":[],"bos_token_id":[1,"2"]}' >"$R/config_token_id_lists"
printf '{"model_type":"llama","vocab_size":64,"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":4}}' >"$R/config_llama3_equal_freq_factors"
shard_header 20240520 1 2147483647 >"$R/tokens_count_int32_max"
shard_header 20240520 1 -2147483648 >"$R/tokens_count_int32_min"
{ shard_header 20240520 2 2; le32 -1; le32 5; } >"$R/tokens_u32_id_4294967295"
{ shard_header 20240520 2 1; bytes 1 2; } >"$R/tokens_u32_half_token"
{ shard_header 20251121 1 1 0 0; le32 0; } >"$R/ref_single_zero_loss"
{ shard_header 20251121 1 536870913; le32 0; } >"$R/ref_count_times_4_wraps_32bit"
{ shard_header 20251121 1 2; le32 0; bytes 0 0 128 255; } >"$R/ref_negative_infinity"
{ shard_header 20251121 1 2; le32 0; bytes 1 0 0 128; } >"$R/ref_negative_denormal"
: >"$R/empty_file"

big=$(find "$OUT" "$R" -type f -size +63k)
if [ -n "$big" ]; then echo "make_corpus: files over 64 KiB: $big" >&2; exit 1; fi
for d in config safetensors shards; do echo "make_corpus: $d: $(ls "$OUT/$d" | wc -l) files"; done
echo "make_corpus: regressions: $(ls "$R" | wc -l) files"
