"""What every config section is: a pydantic model that refuses unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# A name that becomes a folder or a key under a storage root (workload, run, model, Serve
# application): letters, digits, `_.-`, not starting with a dot, so `../` cannot leave the root.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class Section(BaseModel):
    # Numbers are accepted for text fields (labels "0".."9", run_name=2024) as their text.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)
