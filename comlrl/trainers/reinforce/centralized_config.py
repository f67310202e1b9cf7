"""CentralizedMAGRPOConfig: MAGRPO's knobs plus the joint completion's format."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import option
from comlrl.rollout.collaboration import FORMATS, PARSE_FAILURE_POLICIES, CollaborationAdapter, build_adapter
from comlrl.trainers.reinforce.config import MAGRPOConfig


@dataclass
class CentralizedMAGRPOConfig(MAGRPOConfig):
    """Centralized MAGRPO: one model writes every role's response in one joint completion (GRPO on the joint).

    ``num_agents`` counts the roles (comlrl 1.4.3's meaning); one model is trained whatever their
    number, so a per-model field such as a ``device`` list has one entry.
    """

    writes_every_role = True

    num_agents: int = option(2, "Number of roles whose responses the one model writes in each joint completion "
                             "(must agree with the constructor's num_agents); one model is trained.", min=1)
    collaboration_mode: str = option(
        "centralized", "comlrl 1.4.3's switch: always 'centralized' here (for one model per agent use MAGRPOConfig).")
    collaboration_format: str = option(
        "tagged", "Format of the joint completion: 'tagged' (<agent_0>...</agent_0> per role) or 'separated' "
        "(responses in role order joined by section_separator). A collaboration adapter given to the trainer "
        "replaces it.", choices=FORMATS)
    role_names: list | None = option(
        None, "Names of the roles in the joint prompt and as tags (None = agent_0, agent_1, ...); distinct, "
        "identifier-like, one per role.", kind=list, optional=True)
    section_separator: str = option("\n===\n", "Separator between responses in the 'separated' format.")
    parse_failure: str = option(
        "partial", "A joint completion that does not parse (counted in collaboration/parse_error_rate): 'partial' "
        "(each role that could be read keeps its response, the others are scored as empty), 'empty' (every role "
        "scored as empty) or 'raise'.", choices=PARSE_FAILURE_POLICIES)

    @property
    def num_roles(self) -> int:
        return self.num_agents

    def collaboration_adapter(self) -> CollaborationAdapter:
        """The built-in adapter these fields describe."""
        return build_adapter(self.num_agents, self.collaboration_format, self.role_names, self.section_separator)

    def validate(self) -> list[str]:
        name = type(self).__name__
        problems = []
        if self.collaboration_mode != "centralized":
            problems.append(f"CentralizedMAGRPOConfig requires centralized collaboration: {name}.collaboration_mode "
                            f"must be 'centralized', got {self.collaboration_mode!r}; for one model per agent use "
                            "MAGRPOConfig with MAGRPOTrainer")
        if self.num_turns != 1:
            problems.append(f"Centralized MAGRPO currently supports num_turns=1 only: {name}.num_turns="
                            f"{self.num_turns} is not supported: centralized MAGRPO runs one-turn episodes (as comlrl "
                            "1.4.3's); use MAGRPOConfig for multi-turn training")
        try:
            self.collaboration_adapter()
        except ValueError as error:
            problems.append(f"{name}.role_names/section_separator: {error}")
        # The inherited rules count models (device lists, joint samples per prompt): there is one.
        roles = self.num_agents
        self.num_agents = 1
        try:
            problems += super().validate()
        finally:
            self.num_agents = roles
        return problems
