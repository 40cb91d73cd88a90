"""The sample-completion tables of ``fastrl.PPOTrainer`` (TRL's ``generate_completions``): near-greedy responses to
the eval prompts, scored by the reward model, printed with rich and sent to the trackers."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from fastrl.trainers.ppo_math import truncate_response
from fastrl.trainers.ppo_models import get_reward

__all__ = ["TablesMixin", "markdown_table", "print_rich_table"]


class TablesMixin:
    """``PPOTrainer``'s sample completions (its constructor sets what these methods read)."""

    def generate_completions(self, sampling: bool = False):
        """A table of (query, model response, score) for the eval prompts, printed with rich and sent to trackers.

        TRL's: near-greedy sampling (temperature 0.01), responses truncated at the stop token, scored by the
        reward model; ``sampling=True`` (during training) uses one batch only. Runs on a forked RNG so that
        it does not change the training run's random stream.
        """
        import pandas as pd
        from accelerate.utils import gather_object

        args = self.args
        tok = self.processing_class
        pad = tok.pad_token_id
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        acc = self.accelerator
        config = self._rollout_generation_config(0.01 + 1e-7)
        mine = list(range(acc.process_index, len(dataset), acc.num_processes))
        per_process = math.ceil(len(dataset) / acc.num_processes)  # same loop length on every process (gathers)
        bs = args.per_device_eval_batch_size
        table = defaultdict(list)
        devices = [acc.device] if acc.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._unwrapped_for_generation() as unwrapped:
            for start in range(0, per_process, bs):
                idx = mine[start : start + bs]
                query = self._collate(dataset, idx) if idx else None
                queries_text, responses_text, scores = [], [], []
                if query is not None:
                    context_length = query.shape[1]
                    query_response = self._generate(unwrapped.policy, query, query.shape[0], config)
                    response = query_response[:, context_length:]
                    postprocessed_response = response
                    if self.stop_token_id is not None:
                        postprocessed_response = truncate_response(self.stop_token_id, pad, response)
                    _, score, _ = get_reward(
                        self.reward_model, torch.cat((query, postprocessed_response), 1), pad, context_length
                    )
                    queries_text = tok.batch_decode(query, skip_special_tokens=True)
                    responses_text = tok.batch_decode(postprocessed_response)
                    scores = score.float().cpu().tolist()
                table["query"].extend(gather_object(queries_text))
                table["model response"].extend(gather_object(responses_text))
                table["score"].extend(gather_object(scores))
                if sampling:
                    break
        df = pd.DataFrame(table)
        self.last_completions = df
        shown = df.iloc[0:5]
        # A script's final call often comes right after the last update's sample table (same step, same model,
        # near-greedy sampling, so the same rows): print those rows once.
        seen = self._printed_completions
        repeat = seen is not None and seen[0] == self.state.global_step and seen[1].equals(shown)
        self._printed_completions = (self.state.global_step, shown)
        if acc.is_main_process:
            if not repeat:
                print_rich_table(shown)
            self._log_table(df)
        return df

    def _log_table(self, df) -> None:
        report_to = self.args.report_to or []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                wandb.log({"completions": wandb.Table(dataframe=df)})
        if "comet_ml" in report_to:
            from trl.trainer.utils import log_table_to_comet_experiment

            log_table_to_comet_experiment(name="completions.csv", table=df)
        if "trackio" in report_to:
            import trackio

            trackio.log({"completions": trackio.Table(dataframe=df)})
        if "tensorboard" in report_to:
            from transformers.integrations import TensorBoardCallback

            for cb in self.callback_handler.callbacks:
                if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None:
                    cb.tb_writer.add_text("completions", markdown_table(df), self.state.global_step)


def print_rich_table(df) -> None:
    """Print through ``tqdm.write``, which lifts a running progress bar out of the way and redraws it below."""
    from tqdm.auto import tqdm

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        tqdm.write(df.to_string())
        return
    table = Table(show_lines=True)
    for column in df.columns:
        table.add_column(str(column))
    for _, row in df.iterrows():
        table.add_row(*[str(x) for x in row.to_list()])
    console = Console()  # the terminal's width and colours
    with console.capture() as captured:
        console.print(table)
    tqdm.write(captured.get().rstrip("\n"))


def markdown_table(df) -> str:
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in row.to_list()) + " |")
    return "\n".join(lines)
