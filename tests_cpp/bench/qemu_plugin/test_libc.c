/* The counter as the benches use it: a dynamically linked C program that marks regions with the
 * C library's getppid(). The two regions differ only by 100 NOPs, so whatever the library call
 * costs, the difference of their instruction counts is exactly 100 (selftest.sh). The exit
 * status is argv[1], to check that the wrapper passes it on. */
#include <stdlib.h>
#include <unistd.h>

#define REPEAT10(x) x x x x x x x x x x
#define NOPS(n) REPEAT10(REPEAT10("nop\n")) /* 100 */

/* 3 SMMLA, 2 BFMMLA, 4 SDOT per region */
#define MATH                                         \
    "smmla  v0.4s, v1.16b, v2.16b\n"                 \
    "smmla  v3.4s, v4.16b, v5.16b\n"                 \
    "smmla  v6.4s, v7.16b, v8.16b\n"                 \
    "bfmmla v9.4s, v10.8h, v11.8h\n"                 \
    "bfmmla v12.4s, v13.8h, v14.8h\n"                \
    "sdot   v15.4s, v16.16b, v17.16b\n"              \
    "sdot   v15.2s, v16.8b, v17.8b\n"                \
    "sdot   v18.4s, v19.16b, v20.4b[3]\n"            \
    "sdot   v18.2s, v19.8b, v20.4b[0]\n"
#define CLOBBER "v0", "v3", "v6", "v9", "v12", "v15", "v18", "memory"

int main(int argc, char **argv) {
    getppid();                              /* mark 0 (binds the PLT entry) */
    __asm__ volatile(MATH ::: CLOBBER);
    getppid();                              /* mark 1 */
    __asm__ volatile(MATH NOPS(100) ::: CLOBBER);
    getppid();                              /* mark 2 */
    return argc > 1 ? atoi(argv[1]) : 0;
}
