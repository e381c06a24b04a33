from .cli import main

if __name__ == "__main__":  # not when a worker process (serve's validation) imports it again
    main()
