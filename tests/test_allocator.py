"""The CUDA allocator's expandable segments (sft/speed/allocator.py): set for a GPU run as every measured run had
them, unless the user chose a setting."""

from sft.speed.allocator import SETTING, expandable_segments_unless_chosen, variable_for


def test_the_variable_this_torch_reads():
    assert variable_for("2.13.0+cpu") == "PYTORCH_ALLOC_CONF"
    assert variable_for("2.9.0") == "PYTORCH_ALLOC_CONF"
    assert variable_for("2.8.1+cu128") == "PYTORCH_CUDA_ALLOC_CONF"


def test_a_gpu_run_gets_expandable_segments_and_the_first_screen_says_so():
    environ = {}
    line = expandable_segments_unless_chosen(True, environ, "2.11.0+cu130")
    assert environ == {"PYTORCH_ALLOC_CONF": SETTING}
    assert "expandable segments" in line and "PYTORCH_ALLOC_CONF=" in line
    environ = {}
    expandable_segments_unless_chosen(True, environ, "2.7.1")
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": SETTING}


def test_the_users_setting_stands_and_a_cpu_run_is_left_alone():
    for given in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}):
        environ = dict(given)
        assert expandable_segments_unless_chosen(True, environ, "2.11.0") is None
        assert environ == given
    environ = {}
    assert expandable_segments_unless_chosen(False, environ, "2.11.0") is None and environ == {}
