"""comlrl 1.4.3's module path of the actor-critic base: ``ActorCriticTrainerBase`` is :class:`ActorCriticTrainer`.

Only the name lives here; the base is :mod:`comlrl.trainers.actor_critic.base`.
"""

from comlrl.trainers.actor_critic.base import ActorCriticTrainer as ActorCriticTrainerBase

__all__ = ["ActorCriticTrainerBase"]
