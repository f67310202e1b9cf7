"""Actor-critic trainers: IAC (a critic per agent) and MAAC (one centralised critic)."""

from comlrl.trainers.actor_critic.config import IACConfig, MAACConfig
from comlrl.trainers.actor_critic.iac import IACTrainer
from comlrl.trainers.actor_critic.maac import MAACTrainer

__all__ = ["IACConfig", "IACTrainer", "MAACConfig", "MAACTrainer"]
