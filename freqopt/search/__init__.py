"""Search: tuning units, per-unit Optuna studies, exact budget allocation, validation."""

from freqopt.search.allocate import allocate
from freqopt.search.config import SearchConfig
from freqopt.search.result import GranularityResult, SearchResult
from freqopt.search.runner import run_search
from freqopt.search.study import Option, UnitSearch, search_unit
from freqopt.search.units import GRANULARITIES, TuningUnit, partition

__all__ = ["GRANULARITIES", "TuningUnit", "partition", "allocate", "Option", "UnitSearch", "search_unit",
           "SearchConfig", "GranularityResult", "SearchResult", "run_search"]
