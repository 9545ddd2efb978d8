# Cross-compile for aarch64 Linux with Debian's g++-aarch64-linux-gnu; run the built programs
# (ctest, GoogleTest discovery) under qemu-user. The CPU model comes from the QEMU_CPU environment
# variable (qemu's own), so one build tests every model: QEMU_CPU=max (I8MM+BF16),
# QEMU_CPU=neoverse-n1 (dotprod only), QEMU_CPU=cortex-a57 (Armv8.0). Unset means qemu's default,
# which for aarch64 user mode is the `max` model.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CPUMOE_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "Cross compiler prefix")
set(CMAKE_C_COMPILER ${CPUMOE_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${CPUMOE_CROSS_PREFIX}g++)

set(CPUMOE_CROSS_SYSROOT /usr/aarch64-linux-gnu CACHE PATH "Target libraries for qemu -L")
set(CMAKE_FIND_ROOT_PATH ${CPUMOE_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

set(CMAKE_CROSSCOMPILING_EMULATOR "qemu-aarch64;-L;${CPUMOE_CROSS_SYSROOT}")
