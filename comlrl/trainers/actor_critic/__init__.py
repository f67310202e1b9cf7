"""Actor-critic trainers: IAC (a critic per agent) and MAAC (one centralised critic).

``ActorCriticTrainerBase`` and ``RolloutSample`` are the original comlrl's names: the shared base
of IAC and MAAC, and the per-completion record its ``metrics_callback`` receives.
"""

from comlrl.trainers.actor_critic.ac_base import ActorCriticTrainerBase
from comlrl.trainers.actor_critic.base import ActorCriticTrainer
from comlrl.trainers.actor_critic.config import IACConfig, MAACConfig
from comlrl.trainers.actor_critic.iac import IACTrainer
from comlrl.trainers.actor_critic.maac import MAACTrainer
from comlrl.trainers.base import CallbackSample

RolloutSample = CallbackSample

__all__ = ["ActorCriticTrainer", "ActorCriticTrainerBase", "IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer",
           "RolloutSample"]
