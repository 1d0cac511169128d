"""Length objectives: reward-shaping parts (`packrl.reward.shaping`) that make the policy's own
response length a trained target, each one file with its options (``reward.shaping.<part>.<knob>``):

    group_length      Kimi k1.5 (arXiv 2501.12599): shorter than the group's others, rewarded
    efficiency        Arora & Zanette (arXiv 2502.04463): correct answers longer than the group's correct ones, penalised
    shortest_correct  ShorterBetter (arXiv 2504.21370): distance to the group's shortest correct length, penalised
    target_length     L1 / LCPO (arXiv 2503.04697): distance to the target the prompt asks for, penalised

A response's length is the number of tokens the policy generated (`Response.generated_mask`: tool
answers and forced end-of-thinking tokens are not the policy's). "Correct" is the task score
reaching the reward's `packrl.capabilities.RewardInfo.correct_score` for a response no budget
cut (`packrl.reward.shaping.ShapingInputs.correct`): a part that reads it is refused at load with a
reward that declares no notion of correct (`correctness_problems`). Every part's options carry the
accuracy gate (`common.LengthGateOptions`: ``scale_by_pass_rate``, ``min_group_accuracy``,
``warmup_steps``). Docs: docs/algorithms/length_control.md.
"""
