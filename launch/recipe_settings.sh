# Sourced (not run) by launch/quickstart.sh and launch/recipe_scale.sh: the settings their medusa-train,
# medusa-tune-tree and medusa-eval runs share, defined here once.
# Reads: root, conversations, epochs, head_vocab, dtype, tune_prompts, eval_tokens, precision (trainer.precision),
#   distill_choice (auto | vllm | hf: the self-distillation engine; auto: vllm when its environment is installed),
#   distill_dtype (vLLM's dtype, auto: bf16 where the hardware multiplies bf16 natively); optionally model_preset
#   (the target's model/ preset, default smollm2_135m), model_dtype (the frozen target's dtype in training and in the
#   hidden-state cache, default float32) and data_extra (an array of further data.* overrides).
# Sets: vllm_ready, engine, train, tune and evaluate (arrays of overrides), and resumes DIR.
resumes() {  # resumes DIR: true when DIR holds what a killed run of it left (checkpoints, export, replies)
  [[ -d "$1/checkpoints" || -d "$1/export" || -d "$1/self_distill" ]] && echo true || echo false
}
vllm_venv="${MEDUSA_VLLM_VENV:-$root/.venv-vllm}"
vllm_ready=false
[[ -f "$vllm_venv/.medusa-vllm-installed" ]] && vllm_ready=true
engine="$distill_choice"
[[ "$engine" == auto ]] && { engine=hf; [[ "$vllm_ready" == true ]] && engine=vllm; }
distill=(data.self_distill_engine="$engine")
[[ "$engine" == vllm ]] && distill+=(data.self_distill_dtype="$distill_dtype")
echo "== self-distillation engine: $engine ($([[ "$engine" == vllm ]] && echo "dtype $distill_dtype" || echo "the fp32 training model"))" \
  "$([[ "$vllm_ready" == true ]] || echo "- vLLM's environment is not installed: bash launch/install_vllm.sh makes it")"

# the data and trainer settings every drafter trains with (a second drafter reads the first one's replies)
train=(model="${model_preset:-smollm2_135m}" model.dtype="${model_dtype:-float32}" data=sharegpt data.self_distill=true
       "${distill[@]}" "${data_extra[@]}"
       data.max_conversations="$conversations" data.max_prompt_tokens=128 data.max_new_tokens=192
       data.generation_batch_size=128 data.eval_fraction=0.03 max_length=320 hidden_cache=true
       heads.head_vocab_size="$head_vocab" trainer=cpu trainer.precision="$precision" trainer.learning_rate=2e-3
       trainer.num_train_epochs="$epochs" trainer.per_device_train_batch_size=8 trainer.save_steps=100)
# 8 timed prompts: on 4, the composite tree's splits differed by less than their noise (2026-12-02, a fresh clone)
tune=(dtype="$dtype" prompts.num_prompts="$tune_prompts" max_new_tokens=96 latency_sizes='[1,2,4,8,12,16,24,32]'
      max_nodes=31 repeats=3 timed_prompts=8)
# EAGLE-3's tree: the EAGLE-2 dynamic tree beside the static ones (a short shortlist: depths 3 and 5, top-8)
tune_eagle3=('dynamic_depths=[3,5]' 'dynamic_topks=[8]')
evaluate=(prompts=mt_bench per_category=1 max_turns=1 max_new_tokens="$eval_tokens" dtype="$dtype")
