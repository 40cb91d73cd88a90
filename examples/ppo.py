"""PPO with fastrl's fused losses: TRL's PPO example script (``examples/scripts/ppo/ppo.py``), on fastrl.PPOTrainer.

The command lines of TRL's PPO documentation work, with local model and dataset paths in place of hub ids. On a
CPU, build tiny models first (``examples/make_tiny_ppo_models.py``), then:

    python examples/ppo.py \
        --dataset_name tiny_ppo/dataset \
        --dataset_train_split descriptiveness \
        --learning_rate 3e-6 \
        --output_dir tiny_ppo/run \
        --per_device_train_batch_size 4 \
        --gradient_accumulation_steps 1 \
        --total_episodes 16 \
        --model_name_or_path tiny_ppo/policy \
        --sft_model_path tiny_ppo/policy \
        --reward_model_path tiny_ppo/reward \
        --response_length 8 \
        --missing_eos_penalty 1.0

On GPUs, TRL's documented runs (pythia-1b on trl-lib/descriptiveness-sentiment, downloaded beforehand):

    accelerate launch --config_file examples/ppo_configs/deepspeed_zero2.yaml examples/ppo.py \
        --dataset_name trl-lib/descriptiveness-sentiment --dataset_train_split descriptiveness \
        --output_dir models/minimal/ppo --num_ppo_epochs 1 --num_mini_batches 1 --learning_rate 3e-6 \
        --per_device_train_batch_size 1 --gradient_accumulation_steps 16 --total_episodes 10000 \
        --model_name_or_path EleutherAI/pythia-1b-deduped --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path EleutherAI/pythia-1b-deduped --local_rollout_forward_batch_size 1 \
        --missing_eos_penalty 1.0 --bf16

``--resume_from_checkpoint <output_dir>/checkpoint-N`` (with ``--save_strategy steps --save_steps K``) continues a
run. Unlike TRL's script this one does not delete ``output_dir`` first, so that checkpoints survive.
"""

from __future__ import annotations

import torch
from accelerate import PartialState
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, ScriptArguments, get_peft_config

from fastrl import PPOConfig, PPOTrainer

SIMPLE_CHAT_TEMPLATE = "{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + '\n\n'}}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_into_dataclasses()

    ################
    # Model & Tokenizer
    ################
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    trust_remote_code = getattr(model_args, "trust_remote_code", False)
    model_kwargs = dict(
        revision=model_args.model_revision, attn_implementation=model_args.attn_implementation, dtype=dtype,
        trust_remote_code=trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, padding_side="left", trust_remote_code=trust_remote_code
    )
    added_pad = False
    if tokenizer.pad_token is None:  # TRL's example adds "[PAD]"; the embeddings must then grow with it
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        added_pad = True
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    value_model = AutoModelForSequenceClassification.from_pretrained(
        training_args.reward_model_path, num_labels=1, **model_kwargs
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        training_args.reward_model_path, num_labels=1, **model_kwargs
    )
    policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)

    peft_config = get_peft_config(model_args)
    if peft_config is None:
        ref_policy = AutoModelForCausalLM.from_pretrained(training_args.sft_model_path, **model_kwargs)
    else:
        ref_policy = None
    if added_pad:
        for m in (value_model, reward_model, policy, ref_policy):
            if m is not None:
                m.resize_token_embeddings(len(tokenizer))

    ################
    # Dataset
    ################
    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split
    )
    eval_samples = min(100, len(dataset) // 4)
    train_dataset = dataset.select(range(len(dataset) - eval_samples))
    eval_dataset = dataset.select(range(len(dataset) - eval_samples, len(dataset)))
    dataset_text_field = "prompt"

    def prepare_dataset(dataset, tokenizer):
        """pre-tokenize the dataset before training; only collate during training"""

        def tokenize(element):
            outputs = tokenizer(element[dataset_text_field], padding=False)
            return {"input_ids": outputs["input_ids"]}

        return dataset.map(
            tokenize, batched=True, remove_columns=dataset.column_names, num_proc=training_args.dataset_num_proc,
        )

    # Compute that only on the main process for faster data processing.
    with PartialState().local_main_process_first():
        train_dataset = prepare_dataset(train_dataset, tokenizer)
        eval_dataset = prepare_dataset(eval_dataset, tokenizer)

    ################
    # Training
    ################
    trainer = PPOTrainer(
        args=training_args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # Save and push to hub
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)

    trainer.generate_completions()


if __name__ == "__main__":
    main()
