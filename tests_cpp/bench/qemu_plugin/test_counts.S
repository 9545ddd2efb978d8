// Known instruction counts for insn_count.c, checked by selftest.sh: a static program with no C
// library, so qemu executes nothing but what is written here and every count is exact. Each
// region ends with a getppid() svc (a mark); a mark's totals include its own svc.
// Build: aarch64-linux-gnu-gcc -march=armv8.6-a+i8mm+bf16+dotprod -nostdlib -static
// Expected per region: see the comment before each mark, and `expect` in selftest.sh.
        .text
        .globl  _start
_start:
        mov     x8, #173                // getppid: the mark
        svc     #0                      // mark 0: insns 2

// Leaf macros: the loops below only pass register numbers, and the \() that ends a name is
// expanded once, in the leaf (nested .irp bodies would eat it).
        .macro  pos_mm d, n, m
        smmla   v\d\().4s, v\n\().16b, v\m\().16b
        bfmmla  v\d\().4s, v\n\().8h, v\m\().8h
        .endm
        .macro  pos_sdot d, n, m
        sdot    v\d\().4s, v\n\().16b, v\m\().16b
        sdot    v\d\().2s, v\n\().8b, v\m\().8b
        .endm
        .macro  pos_sdot_elem d, n, m, i
        sdot    v\d\().4s, v\n\().16b, v\m\().4b[\i]
        sdot    v\d\().2s, v\n\().8b, v\m\().4b[\i]
        .endm
        .macro  neg d, m
        ummla   v\d\().4s, v1.16b, v\m\().16b
        usmmla  v\d\().4s, v1.16b, v\m\().16b
        udot    v\d\().4s, v1.16b, v\m\().16b
        udot    v\d\().2s, v1.8b, v\m\().8b
        udot    v\d\().4s, v1.16b, v\m\().4b[3]
        usdot   v\d\().4s, v1.16b, v\m\().16b
        usdot   v\d\().4s, v1.16b, v\m\().4b[1]
        sudot   v\d\().4s, v1.16b, v\m\().4b[2]
        bfdot   v\d\().4s, v1.8h, v\m\().8h
        bfdot   v\d\().4s, v1.8h, v\m\().2h[1]
        bfmlalb v\d\().4s, v1.8h, v\m\().8h
        bfmlalt v\d\().4s, v1.8h, v\m\().8h
        fmla    v\d\().4s, v1.4s, v\m\().s[1]
        mul     v\d\().4s, v1.4s, v\m\().s[3]
        sqrdmlah v\d\().4s, v1.4s, v\m\().s[1]
        sqdmulh v\d\().4s, v1.4s, v\m\().s[2]
        mla     v\d\().4s, v1.4s, v\m\().4s    // SDOT (vector) but for bit 21
        .endm

// Region 1, every encoding that must count, with operand fields at 0, mid and all-ones.
        .irp d, 0, 9, 31
        .irp n, 0, 17, 31
        .irp m, 0, 22, 31
        pos_mm  \d, \n, \m
        .endr
        .endr
        .endr                           // 27 SMMLA, 27 BFMMLA
        .irp d, 0, 31
        .irp n, 0, 31
        .irp m, 0, 31
        pos_sdot \d, \n, \m
        .endr
        .endr
        .endr                           // 16 SDOT (vector)
        .irp d, 0, 31
        .irp n, 0, 31
        .irp m, 0, 15, 16, 31           // 16 and 31 set the M bit
        .irp i, 0, 1, 2, 3              // index H:L
        pos_sdot_elem \d, \n, \m, \i
        .endr
        .endr
        .endr
        .endr                           // 128 SDOT (by element)
        svc     #0                      // mark 1: +199 insns, +27 smmla, +27 bfmmla, +144 sdot

// Region 2, neighbouring encodings that must not count (one bit or one field away).
        .irp d, 0, 31
        .irp m, 0, 15                   // by-element FMLA takes V0-V15 only
        neg     \d, \m
        .endr
        .endr                           // 17 forms x 4 = 68
        svc     #0                      // mark 2: +69 insns, nothing else

// Region 3, a loop: the same translated block runs 1000 times.
        mov     x9, #1000
1:      smmla   v0.4s, v1.16b, v2.16b
        bfmmla  v3.4s, v4.8h, v5.8h
        sdot    v6.4s, v7.16b, v8.16b
        sdot    v6.2s, v7.8b, v8.4b[1]
        add     x10, x10, #1
        subs    x9, x9, #1
        b.ne    1b
        svc     #0                      // mark 3: +7002 insns, +1000 smmla, +1000 bfmmla, +2000 sdot

// Region 4, calls and returns: blocks that end at bl / ret.
        mov     x9, #3
2:      bl      one_sdot
        subs    x9, x9, #1
        b.ne    2b
        svc     #0                      // mark 4: +17 insns (1 + 3 x 5 + 1), +3 sdot

        mov     x0, #0
        mov     x8, #94                 // exit_group
        svc     #0                      // exit: +3 insns after mark 4

one_sdot:
        sdot    v9.4s, v10.16b, v11.16b
        ret
