// The one translation unit that compiles the C API of refattn.h (see refattn.h).
#define REFATTN_IMPLEMENTATION
#include "refattn.hpp"
