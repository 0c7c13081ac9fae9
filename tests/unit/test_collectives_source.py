"""Lesson 04 teaches that the hand-written collectives move data with point-to-point
operations only: no collective of PyTorch's may creep into ``collectives.py``."""

import ast
import inspect

from ddp_course import builtin_collectives, collectives

QUERIES = {"is_initialized", "get_rank", "get_world_size", "get_backend", "get_global_rank"}
POINT_TO_POINT = {"isend", "irecv", "batch_isend_irecv", "P2POp"}


def dist_names(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
    }


def test_hand_written_collectives_move_data_with_point_to_point_only():
    assert dist_names(collectives) - QUERIES == POINT_TO_POINT


def test_the_builtin_wrappers_call_pytorchs_collectives():
    # The check above is not vacuous: it sees PyTorch's collectives where they are.
    names = dist_names(builtin_collectives)
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= names
