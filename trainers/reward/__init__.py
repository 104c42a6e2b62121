"""The reward-model stage: the trainer, its loss, its config section and the stage (the reward
model as a scorer is :mod:`trainers.scoring.reward_model`)."""
