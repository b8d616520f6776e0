// The emulator force-includes cuda_emu.h, which provides everything this CUDA header would.
#pragma once
#include "cuda_emu.h"
